"""The real model through real HTTP, Redis and a worker process."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.e2e.conftest import MODEL, Stack, wait_until

pytestmark = pytest.mark.smollm2

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_chat_answer_in_english_whole(stack: Stack):
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 40, "priority": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] > 10 and 0 < usage["completion_tokens"] < 40
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    record = stack.redis.hgetall(stack.keys.req(body["id"]))
    assert record["priority"] == "3" and record["status"] == "finished"
    assert record["completion_tokens"] == str(usage["completion_tokens"])


def test_a_chat_answer_in_english_streamed(stack: Stack):
    chunks = []
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 40, "stream": True,
        "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" in text
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == ["stop"]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_text_completion_with_a_fixed_length(stack: Stack):
    r = httpx.post(f"{stack.base_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "min_tokens": 12,
        "ignore_eos": True, "temperature": 0.8, "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["finish_reason"] == "length"
    again = httpx.post(f"{stack.base_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "min_tokens": 12,
        "ignore_eos": True, "temperature": 0.8, "seed": 7}).json()
    assert again["choices"][0]["text"] == body["choices"][0]["text"]  # same seed, same answer


def test_with_the_slot_busy_requests_get_it_by_priority_then_arrival(stack: Stack):
    """One slot held by a long answer; requests at 0, 5, 0, 9, 5 queue behind it, the long one is
    cancelled, and the slot goes to them in the order 9, 5, 5, 0, 0 (the worker's claim order)."""
    busy_started = threading.Event()
    release = threading.Event()

    def hold_the_slot() -> None:
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True,
            "stream": True, "priority": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    busy_started.set()
                    if release.is_set():
                        return  # closing the stream: the client is gone, the slot frees

    holder = threading.Thread(target=hold_the_slot)
    holder.start()
    assert busy_started.wait(120)
    results: dict[str, dict] = {}

    def ask(name: str, priority: int) -> None:
        r = httpx.post(f"{stack.base_url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": f"Request {name}:", "max_tokens": 2, "priority": priority})
        results[name] = r.json()

    askers = []
    for i, priority in enumerate([0, 5, 0, 9, 5]):
        t = threading.Thread(target=ask, args=(f"r{i}", priority))
        t.start()
        askers.append(t)
        wait_until(lambda: stack.redis.zcard(stack.keys.waiting) == i + 1, "the request to be queued", 30)
    release.set()
    holder.join(120)
    for t in askers:
        t.join(300)
    assert set(results) == {"r0", "r1", "r2", "r3", "r4"}
    claim_seq = {name: int(stack.redis.hget(stack.keys.req(body["id"]), "claim_seq")) for name, body in results.items()}
    assert sorted(claim_seq, key=claim_seq.get) == ["r3", "r1", "r4", "r0", "r2"]
