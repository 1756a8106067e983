"""The answer assembled from the worker's events: whole, streamed, and a client that leaves."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from queues.claims import Claims
from queues.records import Done, Failed, Token
from tests.helpers.api import sse_events

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def test_whole_chat_answer_with_usage(http, worker):
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(http.post, CHAT, json={"messages": HI, "priority": 2})
        (request_id,) = worker.wait_for(1)
        worker.publish(request_id, Token("Hel", [1]), Token("lo", [2]), Done("stop", 12, 2))
        response = future.result(10)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == request_id
    assert response.headers["x-strata-priority"] == "2"
    body = response.json()
    assert body["id"] == request_id and body["object"] == "chat.completion" and body["model"] == "tiny"
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                "finish_reason": "stop", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}


def test_whole_text_completion(http, worker):
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(http.post, "/v1/completions", json={"prompt": "Once", "max_tokens": 3})
        (request_id,) = worker.wait_for(1)
        worker.publish(request_id, Token(" upon", [1]), Token(" a", [2]), Token(" time", [3]), Done("length", 4, 3))
        body = future.result(10).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == " upon a time"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 7


def test_worker_failure_is_an_error_body(http, worker):
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(http.post, CHAT, json={"messages": HI})
        (request_id,) = worker.wait_for(1)
        worker.publish(request_id, Token("x", [1]), Failed("the engine ran out of memory"))
        response = future.result(10)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "the engine ran out of memory"
    assert response.json()["error"]["code"] == "engine_error"


def test_chat_stream_sequence(http, worker):
    body = {"messages": HI, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", CHAT, json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        request_id = response.headers["x-request-id"]
        entry_ids = worker.publish(request_id, Token("Hel", [1]), Token("lo", [2]), Done("stop", 12, 2))
        events = sse_events(response)
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert events[-1] == {"data": "[DONE]"}
    assert all(c["id"] == request_id and c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None}],
        [],
    ]
    assert chunks[-1]["usage"] == {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}
    # SSE ids are the Redis stream entry ids: a client can resume after the last one it saw.
    assert [e.get("id") for e in events[1:4]] == entry_ids


def test_text_stream_without_usage(http, worker):
    with http.stream("POST", "/v1/completions", json={"prompt": "Once", "stream": True}) as response:
        request_id = response.headers["x-request-id"]
        worker.publish(request_id, Token(" upon", [1]), Done("length", 4, 1))
        events = sse_events(response)
    assert events[-1] == {"data": "[DONE]"}
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        (" upon", None), ("", "length")]
    assert all(c["object"] == "text_completion" for c in chunks)


def test_stream_failure_is_an_error_event_then_done(http, worker):
    with http.stream("POST", CHAT, json={"messages": HI, "stream": True}) as response:
        request_id = response.headers["x-request-id"]
        worker.publish(request_id, Failed("worker lost", code="worker_lost"))
        events = sse_events(response)
    assert json.loads(events[-2]["data"])["error"]["code"] == "worker_lost"
    assert events[-1] == {"data": "[DONE]"}


def wait_for_cancel(worker, request_id: str, timeout_s: float = 10) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = worker.record(request_id)
        if record.get("status") == "cancelled" or "cancel_requested_ms" in record:
            return record
        time.sleep(0.02)
    raise AssertionError(f"{request_id} was not cancelled: {worker.record(request_id)}")


def test_client_leaving_a_stream_cancels_the_request(http, worker):
    with http.stream("POST", CHAT, json={"messages": HI, "stream": True}) as response:
        request_id = response.headers["x-request-id"]
        worker.publish(request_id, Token("Hel", [1]))
        lines = response.iter_lines()
        while "Hel" not in next(lines):
            pass
    # The connection is closed mid-stream.
    record = wait_for_cancel(worker, request_id)
    assert record["status"] == "cancelled"
    assert worker.waiting() == []


def test_client_leaving_a_whole_request_cancels_it(api, worker):
    with ThreadPoolExecutor(1) as pool:
        def leave_early():
            with httpx.Client(base_url=api, timeout=0.5) as client:
                try:
                    client.post(CHAT, json={"messages": HI})
                except httpx.TimeoutException:
                    pass
        future = pool.submit(leave_early)
        (request_id,) = worker.wait_for(1)
        future.result(10)
    assert wait_for_cancel(worker, request_id)["status"] == "cancelled"


def test_a_running_request_gets_cancel_requested(http, worker, redis_client):
    claims = Claims(redis_client, "tiny", "w1")
    with http.stream("POST", CHAT, json={"messages": HI, "stream": True}) as response:
        request_id = response.headers["x-request-id"]
        (head,) = claims.head()
        assert claims.claim(head, now_ms=int(time.time() * 1000)) is not None
        worker.publish(request_id, Token("Hel", [1]))
        lines = response.iter_lines()
        while "Hel" not in next(lines):
            pass
    record = wait_for_cancel(worker, request_id)
    assert "cancel_requested_ms" in record
