"""What a request looks like once it is in Redis."""

import json
from contextlib import ExitStack

import httpx

from tests.helpers.api import FakeTokenizer

CHAT = "/v1/chat/completions"


def open_stream(stack: ExitStack, http: httpx.Client, body: dict) -> httpx.Response:
    response = stack.enter_context(http.stream("POST", CHAT, json={"stream": True, **body}))
    assert response.status_code == 200, response.read()
    return response


def test_request_is_enqueued_with_priority_and_prompt_ids(http, worker):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    with ExitStack() as stack:
        response = open_stream(stack, http, {"messages": messages, "priority": 7, "max_tokens": 5,
                                             "temperature": 0, "stop": "\n", "seed": 3})
        request_id = response.headers["x-request-id"]
        assert request_id.startswith("chatcmpl-")
        assert response.headers["x-strata-priority"] == "7"
        assert worker.wait_for(1) == [request_id]
        record = worker.record(request_id)
        assert record["priority"] == "7"
        assert record["status"] == "waiting"
        expected = FakeTokenizer().encode_chat(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}])
        assert worker.prompt(request_id) == expected
        assert record["prompt_tokens"] == str(len(expected))


def test_priorities_are_served_highest_first(http, worker):
    with ExitStack() as stack:
        ids = {}
        for priority in (0, 9, 5):
            response = open_stream(stack, http, {"messages": [{"role": "user", "content": "x"}], "priority": priority})
            ids[priority] = response.headers["x-request-id"]
        assert worker.wait_for(3) == [ids[9], ids[5], ids[0]]


MISSING = object()


def test_odd_priorities_count_as_zero_and_big_ones_are_clamped(http, worker):
    """Rule 1: an integer counts as itself, clamped; anything else counts as 0. Never an error."""
    cases = [(MISSING, "0"), (None, "0"), ("9", "0"), (True, "0"), (False, "0"), (2.5, "0"), (5.0, "0"), ([5], "0"),
             ({"p": 5}, "0"), (-3, "-3"), (10**40, "100"), (-(10**40), "-100")]
    with ExitStack() as stack:
        for raw, effective in cases:
            body = {"messages": [{"role": "user", "content": "x"}]} | ({} if raw is MISSING else {"priority": raw})
            response = open_stream(stack, http, body)
            assert response.headers["x-strata-priority"] == effective, raw
            assert worker.record(response.headers["x-request-id"])["priority"] == effective, raw


def test_a_non_integer_priority_is_clamped_into_a_range_that_excludes_zero(start_api, worker):
    with httpx.Client(base_url=start_api(priority_min=1, priority_max=10), timeout=10) as http, ExitStack() as stack:
        response = open_stream(stack, http, {"messages": [{"role": "user", "content": "x"}], "priority": "x"})
        assert response.headers["x-strata-priority"] == "1"
        assert worker.record(response.headers["x-request-id"])["priority"] == "1"


def test_max_tokens_defaults_and_is_clamped_to_the_context(http, worker):
    with ExitStack() as stack:
        prompt = "p" * 60  # ctx 64: room for 4
        for body, expected in (({}, 4), ({"max_tokens": 100}, 4), ({"max_tokens": 2}, 2)):
            response = stack.enter_context(
                http.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True, **body}))
            request_id = response.headers["x-request-id"]
            assert request_id.startswith("cmpl-")
            assert json.loads(worker.record(request_id)["params"])["max_tokens"] == expected


def test_full_queue_is_429_with_retry_after_and_sheds_low_priorities_first(start_api, worker):
    base = start_api(max_waiting=2, retry_after_s=3)
    with httpx.Client(base_url=base, timeout=10) as http, ExitStack() as stack:
        for _ in range(2):
            open_stream(stack, http, {"messages": [{"role": "user", "content": "x"}]})
        refused = http.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "stream": True})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "3"
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        urgent = open_stream(stack, http, {"messages": [{"role": "user", "content": "x"}], "priority": 5})
        assert worker.wait_for(3)[0] == urgent.headers["x-request-id"]
