"""Requests that outlive their connection: re-attach to a stream by id (exactly once across a
disconnect), background requests, lookup and cancel by id, and who may see them."""

from __future__ import annotations

import itertools
import json
import random
import time

import httpx
import pytest

from queues.claims import Claims, Held
from queues.lifecycle import RequestStatus
from queues.records import Done, Token
from tests.helpers.api import CHAT, HI, sse_events
from tests.helpers.http import sse

WORDS = [f" w{i}" for i in range(12)]


def now_ms() -> int:
    return int(time.time() * 1000)


def events_until(lines, count: int) -> list[dict]:
    """The next `count` SSE events that carry an id (comments and the opening chunk skipped)."""
    return list(itertools.islice((e for e in sse(lines) if "id" in e), count))


def chat_text(events: list[dict]) -> str:
    return "".join(json.loads(e["data"])["choices"][0]["delta"].get("content") or ""
                   for e in events if e["data"] != "[DONE]" and json.loads(e["data"])["choices"])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reattach_after_a_disconnect_gets_every_token_once_in_order(http, worker, seed):
    rng = random.Random(seed)
    before = rng.randint(1, len(WORDS) - 1)  # published while the first connection reads
    seen = rng.randint(1, before)  # how many of them it read before the connection dropped
    body = {"messages": HI, "stream": True}
    with http.stream("POST", CHAT, json=body, headers={"x-strata-detach": "true"}) as response:
        request_id = response.headers["x-request-id"]
        ids = worker.publish(request_id, *(Token(w, [i]) for i, w in enumerate(WORDS[:before])))
        first = events_until(response.iter_lines(), seen)
    assert [e["id"] for e in first] == ids[:seen]

    with http.stream("GET", f"/v1/requests/{request_id}/events",
                     headers={"Last-Event-ID": first[-1]["id"]}) as again:
        assert again.status_code == 200
        assert again.headers["content-type"].startswith("text/event-stream")
        assert again.headers["x-request-id"] == request_id
        lines = again.iter_lines()
        replayed = events_until(lines, before - seen) if before > seen else []
        # the rest arrives live, after the re-attach
        ids += worker.publish(request_id, *(Token(w, [i]) for i, w in enumerate(WORDS[before:], before)),
                              Done("length", 3, len(WORDS)))
        rest = replayed + [e for e in list(sse(lines))]
    assert rest[-1] == {"data": "[DONE]"}
    assert [e["id"] for e in first + rest[:-1]] == ids  # every entry once, in order
    assert chat_text(first) + chat_text(rest) == "".join(WORDS)
    finish = json.loads(rest[-2]["data"])
    assert finish["object"] == "chat.completion.chunk" and finish["id"] == request_id
    assert finish["choices"][0]["finish_reason"] == "length"
    # the disconnect cancelled nothing: a cancel would have ended the stream with an error
    assert worker.record(request_id)["status"] == "waiting"


def test_reattach_to_a_text_completion_with_after_uses_its_chunks(http, worker):
    with http.stream("POST", "/v1/completions", json={"prompt": "Once", "stream": True,
                                                      "stream_options": {"detach": True, "include_usage": True}}) as r:
        request_id = r.headers["x-request-id"]
    ids = worker.publish(request_id, Token(" upon", [1]), Token(" a", [2]), Token(" time", [3]), Done("stop", 4, 3))
    with http.stream("GET", f"/v1/requests/{request_id}/events", params={"after": ids[0]}) as again:
        events = sse_events(again)
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == request_id for c in chunks)
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks[:3]] == [
        (" a", None), (" time", None), ("", "stop")]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["total_tokens"] == 7  # include_usage, as first asked
    assert [e.get("id") for e in events] == [ids[1], ids[2], ids[3], None, None]
    assert events[-1] == {"data": "[DONE]"}


def test_reattach_from_the_start_replays_the_opening_chunk(http, worker):
    with http.stream("POST", CHAT, json={"messages": HI, "stream": True,
                                         "stream_options": {"detach": True}}) as response:
        request_id = response.headers["x-request-id"]
        created = json.loads(next(line for line in response.iter_lines() if line.startswith("data:"))[6:])["created"]
    worker.publish(request_id, Token("Hi", [1]), Done("stop", 3, 1))
    with http.stream("GET", f"/v1/requests/{request_id}/events") as again:
        events = sse_events(again)
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat_text(events) == "Hi"
    assert {c["created"] for c in chunks} == {created}


def test_reattach_after_the_end_event_is_only_done(http, worker, redis_client):
    claims = Claims(redis_client, "tiny", "w1")
    request_id = http.post(CHAT, json={"messages": HI, "background": True}).json()["id"]
    claimed = claims.claim(claims.head()[0], now_ms())
    (token_id,) = worker.publish(request_id, Token("Hi", [1]))
    assert claims.finish(request_id, claimed.claim_seq, Done("stop", 3, 1), RequestStatus.FINISHED, 1, now_ms())
    done_id = redis_client.xrange(worker.keys.out(request_id))[-1][0]
    with http.stream("GET", f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": done_id}) as again:
        assert sse_events(again) == [{"data": "[DONE]"}]
    with http.stream("GET", f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": token_id}) as again:
        events = sse_events(again)
    assert [e.get("id") for e in events] == [done_id, None]


def test_a_client_without_detach_still_cancels_when_it_leaves(http, worker):
    with http.stream("POST", CHAT, json={"messages": HI, "stream": True}) as response:
        request_id = response.headers["x-request-id"]
        worker.publish(request_id, Token("Hel", [1]))
        events_until(response.iter_lines(), 1)
    deadline = time.monotonic() + 10
    while worker.record(request_id)["status"] != "cancelled":
        assert time.monotonic() < deadline, worker.record(request_id)
        time.sleep(0.02)
    assert worker.waiting() == []


def test_a_reader_that_leaves_cancels_nothing(http, worker):
    with http.stream("POST", CHAT, json={"messages": HI, "background": True, "stream": True}) as response:
        request_id = response.headers["x-request-id"]
    (token_id,) = worker.publish(request_id, Token("Hel", [1]))
    with http.stream("GET", f"/v1/requests/{request_id}/events") as again:
        events_until(again.iter_lines(), 1)
    # a second reader still gets the rest: the first one's leaving wrote no cancel into the stream
    with http.stream("GET", f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": token_id}) as again:
        done_id = worker.publish(request_id, Done("stop", 3, 1))[0]
        events = sse_events(again)
    assert [e.get("id") for e in events] == [done_id, None]
    assert worker.record(request_id)["status"] == "waiting"


# ---- background, lookup, cancel ------------------------------------------------------------


def test_background_request_lifecycle(http, worker, redis_client):
    response = http.post(CHAT, json={"messages": HI, "background": True, "max_tokens": 5, "priority": 3})
    assert response.status_code == 202
    accepted = response.json()
    request_id = accepted["id"]
    assert request_id.startswith("chatcmpl-") and response.headers["x-request-id"] == request_id
    assert response.headers["location"] == f"/v1/requests/{request_id}"
    assert accepted["status"] == "waiting" and accepted["response"] is None
    assert (accepted["object"], accepted["endpoint"], accepted["priority"]) == (
        "strata.request", "/v1/chat/completions", 3)
    # the 202 has been answered and nobody listens: the request still waits for a worker
    assert worker.waiting() == [request_id]
    record = worker.record(request_id)
    assert (record["endpoint"], record["detach"], record["created"]) == (
        "/v1/chat/completions", "1", str(accepted["created"]))

    claims = Claims(redis_client, "tiny", "w1")
    claimed = claims.claim(claims.head()[0], now_ms())
    worker.publish(request_id, Token("Hel", [1]), Token("lo", [2]))
    assert http.get(f"/v1/requests/{request_id}").json()["status"] == "running"
    assert claims.finish(request_id, claimed.claim_seq, Done("stop", 12, 2), RequestStatus.FINISHED, 2, now_ms())

    found = http.get(f"/v1/requests/{request_id}").json()
    assert found["status"] == "finished" and found["error"] is None
    whole = found["response"]
    assert (whole["object"], whole["id"], whole["created"]) == ("chat.completion", request_id, accepted["created"])
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"] == {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}


def test_background_text_completion_is_worded_as_one(http, worker, redis_client):
    request_id = http.post("/v1/completions", json={"prompt": "Once", "background": True}).json()["id"]
    claims = Claims(redis_client, "tiny", "w1")
    claimed = claims.claim(claims.head()[0], now_ms())
    worker.publish(request_id, Token(" upon", [1]))
    claims.finish(request_id, claimed.claim_seq, Done("length", 4, 1), RequestStatus.FINISHED, 1, now_ms())
    whole = http.get(f"/v1/requests/{request_id}").json()["response"]
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == " upon"


def test_cancel_a_waiting_background_request(http, worker, redis_client):
    request_id = http.post(CHAT, json={"messages": HI, "background": True, "queue_timeout": 600}).json()["id"]
    assert redis_client.zrange(worker.keys.deadlines, 0, -1) == [request_id]
    response = http.post(f"/v1/requests/{request_id}/cancel")
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    assert response.json()["error"]["code"] == "cancelled"
    assert worker.waiting() == [] and redis_client.zcard(worker.keys.deadlines) == 0
    assert worker.record(request_id)["status"] == "cancelled"
    found = http.get(f"/v1/requests/{request_id}").json()
    assert (found["status"], found["response"], found["error"]["code"]) == ("cancelled", None, "cancelled")


def test_cancel_a_running_request_ends_the_stream_of_a_reader(http, worker, redis_client):
    request_id = http.post(CHAT, json={"messages": HI, "background": True}).json()["id"]
    claims = Claims(redis_client, "tiny", "w1")
    claimed = claims.claim(claims.head()[0], now_ms())
    with http.stream("GET", f"/v1/requests/{request_id}/events") as reader:
        worker.publish(request_id, Token("Hel", [1]))
        lines = reader.iter_lines()
        events_until(lines, 1)
        assert http.post(f"/v1/requests/{request_id}/cancel").json()["status"] == "running"
        assert "cancel_requested_ms" in worker.record(request_id)
        # the worker sees the cancel at its next step and ends the request
        verdict = claims.report([Held(request_id, claimed.claim_seq, 0, generated=1)], now_ms())
        assert verdict.cancelled == {request_id}
        assert claims.finish(request_id, claimed.claim_seq, None, RequestStatus.CANCELLED, 1, now_ms())
        rest = list(sse(lines))
    assert json.loads(rest[-2]["data"])["error"]["code"] == "cancelled"
    assert rest[-1] == {"data": "[DONE]"}
    assert http.get(f"/v1/requests/{request_id}").json()["status"] == "cancelled"


def not_found(response: httpx.Response) -> None:
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["code"] == "request_not_found"


def test_unknown_and_expired_ids_are_404(http, worker, redis_client):
    not_found(http.get("/v1/requests/chatcmpl-nope"))
    not_found(http.get("/v1/requests/chatcmpl-nope/events"))
    not_found(http.post("/v1/requests/chatcmpl-nope/cancel"))
    request_id = http.post(CHAT, json={"messages": HI, "background": True}).json()["id"]
    # a worker whose --retention-s is 1 finishes it: Redis itself drops the hash and the stream
    claims = Claims(redis_client, "tiny", "w1", retention_s=1)
    claimed = claims.claim(claims.head()[0], now_ms())
    worker.publish(request_id, Token("Hi", [1]))
    assert claims.finish(request_id, claimed.claim_seq, Done("stop", 12, 1), RequestStatus.FINISHED, 1, now_ms())
    assert http.get(f"/v1/requests/{request_id}").json()["status"] == "finished"
    assert 0 < redis_client.pttl(worker.keys.out(request_id)) <= 1000
    deadline = time.monotonic() + 10
    while http.get(f"/v1/requests/{request_id}").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    not_found(http.get(f"/v1/requests/{request_id}"))
    not_found(http.get(f"/v1/requests/{request_id}/events"))
    not_found(http.post(f"/v1/requests/{request_id}/cancel"))
    assert not redis_client.exists(worker.keys.req(request_id), worker.keys.out(request_id))


def test_a_bad_event_id_is_400(http):
    request_id = http.post(CHAT, json={"messages": HI, "background": True}).json()["id"]
    response = http.get(f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": "yesterday"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "Last-Event-ID"


KEYS_YAML = """
keys:
  - name: alerts
    key: "sk-alerts-1"
  - name: battery
    key: "sk-battery-2"
"""


def test_another_keys_request_is_404_and_stays_untouched(start_api, tmp_path, worker):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS_YAML)
    with httpx.Client(base_url=start_api(keys_file=str(path)), timeout=10) as http:
        alerts = {"Authorization": "Bearer sk-alerts-1"}
        battery = {"Authorization": "Bearer sk-battery-2"}
        request_id = http.post(CHAT, json={"messages": HI, "background": True}, headers=alerts).json()["id"]
        not_found(http.get(f"/v1/requests/{request_id}", headers=battery))
        not_found(http.get(f"/v1/requests/{request_id}/events", headers=battery))
        not_found(http.post(f"/v1/requests/{request_id}/cancel", headers=battery))
        assert worker.waiting() == [request_id]  # the other key's cancel did nothing
        assert http.get(f"/v1/requests/{request_id}").status_code == 401
        found = http.get(f"/v1/requests/{request_id}", headers=alerts)
        assert found.status_code == 200 and found.json()["status"] == "waiting"


def test_n_answers_by_id_whole_and_reattached_after_the_first_ends(http, worker, redis_client):
    """A background request of n=2: its lookup holds both choices; a re-attach after answer 1's
    done still ends at answer 0's (the n-th), with usage counting both."""
    request_id = http.post(CHAT, json={"messages": HI, "background": True, "n": 2,
                                       "stream_options": {"include_usage": True}}).json()["id"]
    assert worker.record(request_id)["n"] == "2"
    claims = Claims(redis_client, "tiny", "w1")
    claimed = claims.claim(claims.head()[0], now_ms())
    ids = worker.publish(request_id, Token("A", [1]), Token("B", [2], choice=1), Done("stop", 7, 1, choice=1))
    with http.stream("GET", f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": ids[-1]}) as again:
        lines = again.iter_lines()
        worker.publish(request_id, Token("a", [3]))
        assert claims.finish(request_id, claimed.claim_seq, Done("length", 7, 2), RequestStatus.FINISHED, 3, now_ms())
        rest = [json.loads(e["data"]) for e in sse(lines) if e["data"] != "[DONE]"]
    chunks = [c for c in rest if c["choices"]]
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"].get("content"), c["choices"][0]["finish_reason"])
            for c in chunks] == [(0, "a", None), (0, None, "length")]
    assert rest[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}

    whole = http.get(f"/v1/requests/{request_id}").json()["response"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in whole["choices"]] == \
        [(0, "Aa", "length"), (1, "B", "stop")]
    assert whole["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
