"""Hostile input against a real server with a fake-engine worker behind it: requests generated
from the app's own OpenAPI spec (schemathesis over hypothesis; derandomized, bounded) for every
operation, valid ones, invalid ones and valid bodies with one field swapped for a hostile value;
and hand-made requests nobody's schema would produce. Nothing a client sends gets a 5xx, every
refusal has the one error shape, and a normal request is answered afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from api.app import create_app
from api.settings import ApiSettings
from tests.helpers.api import MODEL, FakeTokenizer
from tests.helpers.batches import fake_worker

LONE = "\ud800"


def nested(depth: int) -> object:
    value: object = "deep"
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = [LONE, f"a{LONE}", "", " ", 1e-300, -1e-300, 0, -1, 2**64, -(2**64), 10**30, 1e308, None, True, [], {},
           [LONE], {"k": LONE}, {LONE: 1}, nested(300), "x" * 5000]


@pytest.fixture
def base_url(redis_url: str) -> Iterator[str]:
    from tests.helpers.http import serve_app

    app = create_app(ApiSettings(redis_url=redis_url, served_model_name=MODEL, ctx=128, default_max_tokens=8),
                     tokenizer=FakeTokenizer())
    with serve_app(app) as url, fake_worker(redis_url, slots=4, step_s=0.0):
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        yield http


SPEC = schemathesis.openapi.from_dict(create_app(ApiSettings(served_model_name=MODEL)).openapi())
OPERATIONS = [(method.upper(), path) for path, methods in SPEC.raw_schema["paths"].items() for method in methods]
JSON_BODIES = ["/v1/chat/completions", "/v1/completions", "/v1/batches"]


def fields_of(path: str) -> list[str]:
    """The body's fields, as the spec lists them."""
    ref = SPEC.raw_schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return sorted(SPEC.raw_schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])


def with_a_hostile_field(case: schemathesis.Case) -> st.SearchStrategy[dict]:
    fields = st.sampled_from(fields_of(case.path))
    return st.tuples(fields, st.sampled_from(HOSTILE)).map(lambda t: {**case.body, t[0]: t[1]})


def assert_answered_or_refused_cleanly(response: httpx.Response, case: object = None) -> None:
    assert response.status_code < 500, (case, response.text)
    if response.status_code >= 400 and response.headers.get("content-type") == "application/json":
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def assert_a_normal_request_is_answered(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


FUZZ = settings(max_examples=50, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_requests_generated_from_the_openapi_spec_never_get_a_5xx(base_url, client, method, path):
    operation = SPEC[path][method]

    @FUZZ
    @given(case=st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                          operation.as_strategy(GenerationMode.NEGATIVE)))
    def valid_and_invalid(case: schemathesis.Case) -> None:
        assert_answered_or_refused_cleanly(case.call(base_url=base_url, timeout=30))

    valid_and_invalid()
    if method == "POST" and path in JSON_BODIES:

        @FUZZ
        @given(body=operation.as_strategy(GenerationMode.POSITIVE).flatmap(with_a_hostile_field))
        def with_hostile_values(body: dict) -> None:
            assert_answered_or_refused_cleanly(send(client, path, body))

        with_hostile_values()
    assert_a_normal_request_is_answered(client)


def send(http: httpx.Client, path: str, body: object) -> httpx.Response:
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


RAW = [
    b'{"messages": [',
    b"nul",
    b"NaN",
    b"[]",
    b'"messages"',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": NaN}',
    b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # a surrogate's bytes: not UTF-8
    b'{"messages": [{"role": "user", "content": "\xff"}]}',
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "' + b"\\ud800" * 1000 + b'"}',
    b"",
]


def test_broken_and_hostile_raw_bodies_get_a_4xx(client):
    for path in JSON_BODIES:
        for raw in RAW:
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (path, raw[:80], response.text)
            assert_answered_or_refused_cleanly(response, (path, raw[:80]))
    assert_a_normal_request_is_answered(client)


HOSTILE_BODIES = [
    ("/v1/chat/completions", {"messages": nested(500)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": nested(500)}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": nested(500)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [""] * 1000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "model": ""}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 10**30,
                              "max_tokens": 10**30, "priority": -(10**400)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": LONE}),
    ("/v1/completions", {"prompt": " ", "temperature": 2, "top_p": 0.01, "top_k": -1, "seed": -(2**63)}),
    ("/v1/completions", {"prompt": "x", "temperature": 1e-300, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "temperature": 5e-324, "top_p": 1e-300, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "temperature": 0.01, "top_p": 0.01, "top_k": 1, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "seed": 2**64, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x" * 10_000}),
    ("/v1/batches", {"input_file_id": "", "endpoint": "", "completion_window": ""}),
    ("/v1/batches", {"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h",
                     "metadata": {LONE: "v"}}),
    ("/v1/batches", {"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h",
                     "metadata": {f"k{i}": "v" for i in range(100)}}),
]


def test_hostile_bodies_never_get_a_5xx(client):
    for path, body in HOSTILE_BODIES:
        assert_answered_or_refused_cleanly(send(client, path, body), (path, str(body)[:200]))
    assert_a_normal_request_is_answered(client)


URLS = ["/v1/files/%ED%A0%80", "/v1/files/%ED%A0%80/content", "/v1/batches/%ED%A0%80", "/v1/models/%ED%A0%80",
        "/v1/files?purpose=%ED%A0%80&limit=-5", "/v1/batches?after=%ED%A0%80&limit=100000000000000000000000",
        "/v1/batches?limit=x", "/v1/files/%00", "/v1/batches/" + "x" * 10_000]


def test_hostile_paths_and_queries_never_get_a_5xx(client):
    for url in URLS:
        assert_answered_or_refused_cleanly(client.get(url), url)
        assert_answered_or_refused_cleanly(client.delete(url), url)
        assert_answered_or_refused_cleanly(client.post(url + ("" if "?" in url else "/cancel")), url)
    assert_a_normal_request_is_answered(client)


HEADERS = [{"x-strata-queue-timeout": v} for v in ("nan", "inf", "1e400", "-1", "0", "x", b"\xff", b"\xed\xa0\x80")] + [
    {"authorization": v} for v in ("Bearer", b"Bearer \xff", "Basic x", "Bearer " + "k" * 10_000)] + [
    {"content-type": v} for v in ("application/json; charset=latin-1", "text/plain", "application/x+json")]


def test_hostile_headers_never_get_a_5xx(client):
    for headers in HEADERS:
        response = client.post("/v1/chat/completions", headers=headers,
                               content=b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}')
        assert_answered_or_refused_cleanly(response, headers)
    assert_a_normal_request_is_answered(client)


def multipart(purpose: bytes, filename: bytes, content: bytes) -> bytes:
    """A multipart body written by hand: a client can put any bytes in it, valid UTF-8 or not."""
    return (b"--B\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n" + purpose + b"\r\n"
            b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + filename + b"\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n" + content + b"\r\n--B--\r\n")


UPLOADS = [multipart(b"\xed\xa0\x80", b"a.jsonl", b"{}"), multipart(b"batch", b"\xed\xa0\x80.jsonl", b"{}"),
           multipart(b"batch", b"\xff.jsonl", b"\xed\xa0\x80"), multipart(b"", b"", b""), b"--B\r\nnot a part"]


def test_hostile_uploads_never_get_a_5xx(client):
    for body in UPLOADS:
        response = client.post("/v1/files", content=body, headers={"content-type": "multipart/form-data; boundary=B"})
        assert_answered_or_refused_cleanly(response, body)
        if response.status_code == 200:  # what was stored reads back, alone and listed
            assert_answered_or_refused_cleanly(client.get(f"/v1/files/{response.json()['id']}"), body)
            assert client.get("/v1/files").status_code == 200
    assert_a_normal_request_is_answered(client)
