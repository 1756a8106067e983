"""Validation at the door: every number the engine uses is bounded, and text UTF-8 cannot encode
(a lone surrogate, which a JSON escape can carry) is refused naming its field, so no value a
client controls reaches a worker to fail it there."""

from __future__ import annotations

import json
from contextlib import ExitStack

import httpx
import pytest

from tests.helpers.api import assert_error, assert_still_serves

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
LONE = "\ud800"  # a lone surrogate: valid in a JSON escape, not in UTF-8


def post(http: httpx.Client, path: str, body: object) -> httpx.Response:
    """JSON with \\u escapes (json.dumps' default): how a client sends a lone surrogate."""
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"messages": [{"role": "user", "content": f"a{LONE}b"}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, "messages.0.content.0.text"),
    (CHAT, {"messages": HI, "model": LONE}, "model"),
    (CHAT, {"messages": HI, "stop": ["\n", LONE]}, "stop.1"),
    (CHAT, {"messages": HI, "user": LONE}, "user"),  # even a field Strata ignores
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/v1/completions", {"prompt": [f"x{LONE}"]}, "prompt.0"),
    ("/v1/batches", {"input_file_id": f"file-{LONE}", "endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
    ("/v1/batches", {"input_file_id": "file-1", "endpoint": LONE, "completion_window": "24h"}, "endpoint"),
    ("/v1/batches", {"input_file_id": "file-1", "endpoint": CHAT, "completion_window": "24h",
                     "metadata": {"team": LONE}}, "metadata.team"),
])
def test_text_utf8_cannot_encode_is_400_naming_the_field(http, worker, path, body, param):
    error = assert_error(post(http, path, body), 400, code="invalid_value", param=param)
    assert param in error["message"]
    assert worker.waiting() == []
    assert_still_serves(http, worker)


@pytest.mark.parametrize(("body", "param"), [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"temperature": 1e-300}, "temperature"),
    ({"temperature": 0.009}, "temperature"),
    ({"top_p": 1e-300}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 2**31}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_numbers_outside_what_the_engine_takes_are_400(http, worker, body, param):
    assert_error(post(http, CHAT, {"messages": HI, **body}), 400, code="invalid_value", param=param)
    assert worker.waiting() == []
    assert_still_serves(http, worker)


@pytest.mark.parametrize("prompt", ["", [""]])
def test_an_empty_prompt_is_400(http, worker, prompt):
    assert_error(post(http, "/v1/completions", {"prompt": prompt}), 400, param="prompt")
    assert_still_serves(http, worker)


def test_the_bounds_themselves_are_accepted_and_reach_the_worker_unchanged(http, worker):
    edges = [{"seed": 2**64 - 1}, {"seed": -(2**63)}, {"temperature": 0}, {"temperature": 0.01, "top_p": 0.01},
             {"top_k": 2**31 - 1}, {"max_tokens": 10**30}]
    with ExitStack() as stack:
        for body in edges:
            response = stack.enter_context(http.stream("POST", CHAT, json={"messages": HI, "stream": True, **body}))
            assert response.status_code == 200, response.read()
            params = json.loads(worker.record(response.headers["x-request-id"])["params"])
            expected = {**body, "max_tokens": params["max_tokens"]} if "max_tokens" in body else body
            assert {k: params[k] for k in expected} == expected
            assert params["max_tokens"] <= 64  # a huge max_tokens is lowered to what fits the context


class StrictTemplate:
    """A tokenizer whose chat template refuses a conversation, as some models' templates do (with
    jinja's raise_exception: "roles must alternate")."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        from jinja2 import TemplateError

        if len(messages) > 1 and messages[-1]["role"] == messages[-2]["role"]:
            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def test_a_conversation_the_chat_template_refuses_is_400(start_api, worker):
    with httpx.Client(base_url=start_api(tokenizer=StrictTemplate()), timeout=10) as http:
        error = assert_error(post(http, CHAT, {"messages": HI + HI}), 400, code="invalid_value", param="messages")
        assert "alternate" in error["message"]
        assert_still_serves(http, worker)
