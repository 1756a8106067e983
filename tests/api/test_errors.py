"""Each bad input gets its status and the one error shape; the server keeps serving."""

import json
import time

import httpx
import pytest

from queues.membership import Membership
from queues.worker_state import WorkerState
from tests.helpers.api import assert_error, assert_still_serves

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": HI, "max_tokens": "x"}, "max_tokens"),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(http, worker, body, param):
    error = assert_error(http.post(CHAT, json=body), 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert_still_serves(http, worker)


def test_broken_json_is_400(http, worker):
    response = http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(response, 400, code="invalid_json")
    assert_still_serves(http, worker)


def test_unknown_model_is_404(http, worker):
    assert_error(http.post(CHAT, json={"messages": HI, "model": "gpt-9"}), 404, code="model_not_found", param="model")
    assert_still_serves(http, worker)


def test_prompt_longer_than_ctx_is_400(http, worker):
    long = [{"role": "user", "content": "x" * 100}]  # ctx is 64 fake tokens
    assert_error(http.post(CHAT, json={"messages": long}), 400, code="context_length_exceeded")
    response = http.post("/v1/completions", json={"prompt": "y" * 64})
    assert_error(response, 400, code="context_length_exceeded", param="prompt")
    assert_still_serves(http, worker)


def test_n_outside_1_to_16_is_400(http, worker):
    for n in (0, -1, 17):
        assert_error(http.post(CHAT, json={"messages": HI, "n": n}), 400, code="invalid_value", param="n")
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "n": 2, "best_of": 3}), 400, param="best_of")
    assert_still_serves(http, worker)


def test_completion_prompt_list_must_hold_one_string(http, worker):
    assert_error(http.post("/v1/completions", json={"prompt": ["a", "b"]}), 400, param="prompt")
    assert_still_serves(http, worker)


def test_oversized_body_is_413(start_api, worker):
    base = start_api(max_body_bytes=1000)
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}]}).encode()
    with httpx.Client(base_url=base, timeout=10) as http:
        assert_error(http.post(CHAT, content=body, headers={"content-type": "application/json"}),
                     413, code="request_too_large")

        def chunked():  # no Content-Length: counted while read
            yield body[:600]
            yield body[600:]

        assert_error(http.post(CHAT, content=chunked(), headers={"content-type": "application/json"}),
                     413, code="request_too_large")
        assert_still_serves(http, worker)


def test_unknown_route_and_method_use_the_same_shape(http):
    assert_error(http.get("/v1/nothing"), 404, code="not_found")
    assert_error(http.get(CHAT), 405, code="method_not_allowed")


def test_models_lists_the_served_model(http, redis_client):
    assert http.get("/v1/models").json() == {"object": "list", "data": []}  # no worker yet
    assert_error(http.get("/v1/models/tiny"), 404, code="model_not_found")
    Membership(redis_client, "tiny", "w1").heartbeat(WorkerState(slots_total=1), int(time.time() * 1000), ttl_s=10)
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert http.get("/v1/models/tiny").json()["object"] == "model"
    assert_error(http.get("/v1/models/other"), 404, code="model_not_found")


class BrokenTokenizer:
    def encode(self, text):
        raise RuntimeError("boom")

    encode_chat = encode


def test_unexpected_exception_is_500_in_the_same_shape(start_api, worker):
    with httpx.Client(base_url=start_api(tokenizer=BrokenTokenizer()), timeout=10) as http:
        error = assert_error(http.post("/v1/completions", json={"prompt": "x"}), 500, code="internal_error")
        assert error["type"] == "server_error" and "boom" not in error["message"]
        assert http.get("/health").status_code == 200
