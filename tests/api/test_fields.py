"""Honest refusals: every OpenAI request field is honoured, refused with a 400 naming it (nothing
enqueued), or accepted because it changes nothing; a field that is not OpenAI's is ignored,
logged once and named in a header. docs/api.md's table says the same as the code."""

from __future__ import annotations

import logging
import re
import typing
from pathlib import Path

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from shapes.fields import REFUSED_CHAT, REFUSED_COMPLETIONS, IgnoredFields, treatment
from shapes.requests import ChatCompletionRequest, CompletionRequest
from tests.helpers.api import assert_error

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
SCHEMAS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}


def openai_fields(params: type) -> set[str]:
    return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize(("endpoint", "params"), [("chat", chat_create_params), ("completions", completion_create_params)])
def test_every_openai_field_is_classified(endpoint, params):
    unclassified = {name for name in openai_fields(params) if treatment(SCHEMAS[endpoint], name) is None}
    assert unclassified == set()


def doc_table() -> dict[tuple[str, str], str]:
    """(endpoint, field) -> treatment, from docs/api.md's table of request fields."""
    rows: dict[tuple[str, str], str] = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2] in ("honoured", "refused", "accepted"):
            endpoints = ["chat", "completions"] if cells[1] == "both" else [cells[1]]
            for name in re.findall(r"`([a-z_]+)`", cells[0]):
                for endpoint in endpoints:
                    rows[(endpoint, name)] = cells[2]
    return rows


def test_the_docs_table_says_what_the_code_does():
    documented = doc_table()
    assert documented, "docs/api.md has no table of request fields"
    for (endpoint, name), said in documented.items():
        assert treatment(SCHEMAS[endpoint], name) == said, (endpoint, name)
    # and every field the code knows is in the table
    for endpoint, schema in SCHEMAS.items():
        known = set(schema.model_fields) | set(schema.refused) | set(schema.accepted)
        assert {n for n in known if (endpoint, n) not in documented} == set(), endpoint


def asking(name: str) -> object:
    """A value of the field that asks for something."""
    return {"logprobs": True, "modalities": ["text", "audio"], "best_of": 2, "repetition_penalty": 1.2,
            "typical_p": 0.5}.get(name, 0.5)


REFUSALS = [(CHAT, name) for name in REFUSED_CHAT] + \
    [(COMPLETIONS, name) for name in REFUSED_COMPLETIONS]


@pytest.mark.parametrize(("path", "name"), REFUSALS)
def test_a_refused_field_is_400_naming_it_and_nothing_is_enqueued(http, worker, redis_client, path, name):
    body = {"messages": HI} if path == CHAT else {"prompt": "hi"}
    before = set(redis_client.keys("*"))
    response = http.post(path, json={**body, name: asking(name)})
    error = assert_error(response, 400, code="unsupported_parameter", param=name)
    assert name in error["message"]
    assert worker.waiting() == []
    assert set(redis_client.keys("*")) == before  # no request hash, no stream


@pytest.mark.parametrize(("name", "value"), [
    ("logprobs", False), ("frequency_penalty", 0), ("presence_penalty", 0.0), ("logit_bias", {}),
    ("tools", []), ("response_format", {"type": "text"}), ("modalities", ["text"]), ("top_logprobs", None),
    ("user", "u-1"), ("metadata", {"team": "a"}), ("store", False), ("service_tier", "auto"),
    ("safety_identifier", "s"), ("prompt_cache_key", "k"),
])
def test_a_value_that_asks_for_nothing_and_an_accepted_field_are_enqueued(http, worker, name, value):
    response = http.post(CHAT, json={"messages": HI, name: value, "background": True})
    assert response.status_code == 202, response.text
    assert worker.wait_for(1) == [response.headers["x-request-id"]]
    assert "x-strata-ignored-fields" not in response.headers


def test_logprobs_are_bounded_and_top_logprobs_need_logprobs(http, worker):
    assert_error(http.post(COMPLETIONS, json={"prompt": "hi", "logprobs": 21}), 400, param="logprobs")
    assert_error(http.post(CHAT, json={"messages": HI, "top_logprobs": 21, "logprobs": True}), 400,
                 param="top_logprobs")
    assert http.post(CHAT, json={"messages": HI, "top_logprobs": 3}).status_code == 400
    assert http.post(CHAT, json={"messages": HI, "logprobs": False, "background": True}).status_code == 202


def test_a_field_that_is_not_openais_is_ignored_and_named_in_a_header(http, worker):
    response = http.post(CHAT, json={"messages": HI, "priorty": 5, "background": True, "x_flag": {"a": 1}})
    assert response.status_code == 202, response.text
    assert response.headers["x-strata-ignored-fields"] == "priorty,x_flag"
    request_id = worker.wait_for(1)[0]
    assert worker.record(request_id)["priority"] == "0"  # the misspelt one changed nothing


def test_an_ignored_name_a_header_cannot_carry_is_escaped(http, worker):
    response = http.post(CHAT, json={"messages": HI, "prïority": 1, "background": True})
    assert response.status_code == 202, response.text
    assert response.headers["x-strata-ignored-fields"] == "pr\\xefority"


def test_ignored_names_with_control_characters_or_empty_still_answer(http, worker):
    # the fuzz test found these: a raw control character made uvicorn drop the response
    response = http.post(CHAT, json={"messages": HI, "a\x1eb": 1, "": 2, "background": True})
    assert response.status_code == 202, response.text
    assert response.headers["x-strata-ignored-fields"] == 'a\\x1eb,""'


def test_the_names_logged_are_bounded(caplog):
    ignored = IgnoredFields()
    with caplog.at_level(logging.WARNING, logger="strata.api"):
        ignored.note([f"f{i}" for i in range(IgnoredFields.MAX_SEEN + 5)])
        ignored.note(["one_more"])
    assert len(ignored.seen) == IgnoredFields.MAX_SEEN
    assert len(caplog.records) == IgnoredFields.MAX_SEEN


def test_ignored_names_are_logged_once_each(caplog):
    ignored = IgnoredFields()
    with caplog.at_level(logging.WARNING, logger="strata.api"):
        ignored.note(["priorty"])
        ignored.note(["priorty", "tempurature"])
        ignored.note(["tempurature"])
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2
    assert "'priorty'" in logged[0] and "'tempurature'" in logged[1]
