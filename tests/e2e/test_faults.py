"""Faults injected into a running `strata serve` (two workers, the real SmolLM2 file on the
default engine: bf16, Q4_1 blocks for decode and prompts (engine.md); eager, as the compiled step's own
tests cover it): a worker frozen past its lease, workers killed with SIGKILL, the embedded Redis
killed; and, without a fault, one request repeated (cold, its first block cached, batched, on the
other worker). Every accepted request ends exactly once, its text as an undisturbed run gives it, token
for token: the worker that takes a request over reads its prompt and replays the answer so far
as the decode steps fed it (engine/runner.py `replay`). A worker that lost a claim writes
nothing more."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from queues.keys import Keys
from queues.server import free_port, terminate
from queues.settings import environ_without_settings
from tests.e2e.conftest import MODEL, healthy, sse, wait_until

pytestmark = pytest.mark.smollm2

K = Keys(MODEL)
ANSWER_TOKENS = 48


@dataclass
class Serve:
    base: str
    data: Path
    log: Path
    process: subprocess.Popen

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url((self.data / "redis.url").read_text(), decode_responses=True,
                                    socket_timeout=5)

    def worker_pids(self) -> list[int]:
        """The live workers (a killed one's entry may outlast it until its lease runs out)."""
        client = self.redis()
        try:
            pids = [int(w.rsplit("-", 2)[1]) for w in client.zrange(K.workers, 0, -1)]
        finally:
            client.close()
        return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    folder = tmp_path_factory.mktemp("faults")
    port = free_port()
    log = folder / "serve.log"
    env = environ_without_settings()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "strata", "serve", "--port", str(port), "--data-dir", str(folder / "data"),
             "--devices", "cpu,cpu", "--parallel", "2", "--threads", "1", "--no-compile",
             "--lease-ms", "8000", "--heartbeat-s", "0.5", "--restart-delay-s", "0.5", "--prefill-chunk", "64",
             "--max-attempts", "10"],  # three kills may all hit one request: no poison
            env=env, stdout=out, stderr=subprocess.STDOUT)
    s = Serve(f"http://127.0.0.1:{port}", folder / "data", log, process)
    try:
        wait_until(lambda: healthy(s.base), "the API", 240)
        wait_until(lambda: (s.data / "redis.url").exists() and len(s.worker_pids()) == 2, "two workers", 240)
        yield s
    finally:
        terminate(process, 60)


@dataclass
class Streamed:
    """One streaming chat completion, read in a thread."""

    prompt: str
    id: str = ""
    text: str = ""
    events: list[dict] = field(default_factory=list)
    done: bool = False
    error: str = ""

    def run(self, base: str) -> None:
        try:
            with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=600, json={
                "model": MODEL, "messages": [{"role": "user", "content": self.prompt}], "temperature": 0,
                "max_tokens": ANSWER_TOKENS, "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200, r.read()
                self.id = r.headers["x-request-id"]
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        self.events.append(event)
                        for choice in event.get("choices", []):
                            self.text += choice["delta"].get("content") or ""
        except Exception as error:  # noqa: BLE001 - reported by the test
            self.error = repr(error)


def ask_all(base: str, prompts: list[str], during=None) -> list[Streamed]:
    """Stream every prompt at once; `during(streams)` runs while they are in flight."""
    streams = [Streamed(p) for p in prompts]
    threads = [threading.Thread(target=s.run, args=(base,)) for s in streams]
    for t in threads:
        t.start()
    if during:
        during(streams)
    for t in threads:
        t.join(600)
    return streams


def assert_ended_exactly_once_as_undisturbed(serve: Serve, got: list[Streamed], reference: dict[str, str]) -> None:
    client = serve.redis()
    try:
        for s in got:
            assert s.error == "" and s.done, (s.prompt, s.error)
            entries = [f for _, f in client.xrange(K.out(s.id))]
            ids = [i for e in entries if e["type"] == "token" for i in e["ids"].split(",") if i]
            assert [e["type"] for e in entries].count("done") == 1 and entries[-1]["type"] == "done", s.id
            assert len(ids) == ANSWER_TOKENS, s.id  # every token once: none repeated, none lost
            assert s.text == reference[s.prompt], s.prompt
            assert client.hget(K.req(s.id), "status") == "finished"
    finally:
        client.close()


def references(serve: Serve, prompts: list[str]) -> dict[str, str]:
    got = ask_all(serve.base, prompts)
    assert all(s.done and not s.error for s in got)
    return {s.prompt: s.text for s in got}


def owner_pid(serve: Serve, request_id: str) -> int | None:
    client = serve.redis()
    try:
        worker = client.hget(K.req(request_id), "worker")
    finally:
        client.close()
    return int(worker.rsplit("-", 2)[1]) if worker else None


def tokens_seen(s: Streamed) -> int:
    return sum(1 for e in s.events for c in e.get("choices", []) if c["delta"].get("content"))


def test_a_worker_frozen_past_its_lease_writes_nothing_when_it_wakes(serve: Serve):
    prompts = ["Frozen worker: tell me about rivers.", "Frozen worker: tell me about mountains."]
    reference = references(serve, prompts)
    frozen: list[int] = []

    def freeze_one(streams: list[Streamed]) -> None:
        wait_until(lambda: all(s.id for s in streams) and tokens_seen(streams[0]) >= 5, "tokens", 120)
        pid = owner_pid(serve, streams[0].id)
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
        # the other worker takes the request back once the 8 s lease has run out, and goes on
        wait_until(lambda: owner_pid(serve, streams[0].id) not in (pid, None), "another worker", 60)
        time.sleep(1.0)
        os.kill(pid, signal.SIGCONT)  # it wakes with a stale slot and reports it

    got = ask_all(serve.base, prompts, during=freeze_one)
    assert_ended_exactly_once_as_undisturbed(serve, got, reference)
    wait_until(lambda: f"[{frozen[0]}] WARNING" in serve.log.read_text() and "lost claim" in serve.log.read_text(),
               "the revived worker's log", 30)
    lines = [line for line in serve.log.read_text().splitlines() if f"[{frozen[0]}]" in line]
    assert any(got[0].id in line and "lost claim" in line for line in lines)


def test_workers_killed_again_and_again_under_load(serve: Serve):
    prompts = [f"Killed workers {i}: write a short poem about the number {i}." for i in range(8)]
    reference = references(serve, prompts)
    killed: list[int] = []

    def kill_three_times(streams: list[Streamed]) -> None:
        for _ in range(3):
            def claimed() -> list[int]:
                return [p for s in streams if s.id and not s.done and (p := owner_pid(serve, s.id)) not in (None, *killed)]

            wait_until(lambda: claimed() or all(s.done for s in streams), "a claimed request", 120)
            if not claimed():
                return
            killed.append(claimed()[0])
            os.kill(killed[-1], signal.SIGKILL)  # mid-answer; serve restarts it
            time.sleep(2.0)

    got = ask_all(serve.base, prompts, during=kill_three_times)
    assert len(killed) == 3
    assert_ended_exactly_once_as_undisturbed(serve, got, reference)


def test_the_embedded_redis_killed_under_load_comes_back_and_nothing_is_lost(serve: Serve):
    prompts = [f"Redis killed {i}: describe a city in one paragraph, number {i}." for i in range(6)]
    reference = references(serve, prompts)

    def kill_redis(streams: list[Streamed]) -> None:
        wait_until(lambda: sum(tokens_seen(s) >= 3 for s in streams) >= 2, "answers under way", 120)
        client = serve.redis()
        pid = int(client.info("server")["process_id"])
        client.close()
        os.kill(pid, signal.SIGKILL)  # 4 requests decoding, 2 waiting

    got = ask_all(serve.base, prompts, during=kill_redis)
    assert_ended_exactly_once_as_undisturbed(serve, got, reference)
    assert "embedded Redis exited; restarting it" in serve.log.read_text()


def api_pid(serve: Serve) -> int | None:
    """The `strata api` child of this serve (serve restarts it under a new pid)."""
    parent = serve.process.pid
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in children:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if argv[-3:-1] == [b"strata", b"api"]:  # python -m strata api, NUL-terminated
            return int(pid)
    return None


@pytest.mark.parametrize("with_worker", [False, True], ids=["api", "api-and-worker"])
def test_a_detached_stream_survives_its_api_killed_and_reattaches(serve: Serve, with_worker: bool):
    """The client re-attaches to the restarted API with its last event id and gets the rest once."""
    prompt = f"Reattach ({with_worker}): tell a short story about a lost key."
    reference = references(serve, [prompt])[prompt]
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": ANSWER_TOKENS, "ignore_eos": True, "stream": True, "stream_options": {"detach": True}}
    events: list[dict] = []
    with httpx.stream("POST", f"{serve.base}/v1/chat/completions", json=body, timeout=300) as r:
        request_id = r.headers["x-request-id"]
        for event in sse(r.iter_lines()):
            events.append(event)
            if sum("id" in e for e in events) == 5:
                break
        old_api = api_pid(serve)
        assert old_api is not None
        if with_worker:
            os.kill(owner_pid(serve, request_id), signal.SIGKILL)
        os.kill(old_api, signal.SIGKILL)  # mid-stream; serve restarts it
    wait_until(lambda: api_pid(serve) not in (None, old_api) and healthy(serve.base), "a new API", 120)
    with httpx.stream("GET", f"{serve.base}/v1/requests/{request_id}/events", timeout=300,
                      headers={"Last-Event-ID": events[-1]["id"]}) as again:
        assert again.status_code == 200
        rest = list(sse(again.iter_lines()))
    assert rest[-1] == {"data": "[DONE]"}
    text = "".join(c["delta"].get("content") or "" for e in events + rest[:-1]
                   for c in json.loads(e["data"])["choices"])
    assert text == reference  # every token once, in order
    client = serve.redis()
    try:
        entries = [f for _, f in client.xrange(K.out(request_id))]
        assert sum(len(f["ids"].split(",")) for f in entries if f["type"] == "token") == ANSWER_TOKENS
        assert client.hget(K.req(request_id), "status") == "finished"
    finally:
        client.close()


# Over one prompt block (engine/model.py PROMPT_BLOCK, 64): a repeat finds its first block cached.
REPEATED = ("A repeated request, asked in the foreground and then in the background: describe, in plain words "
            "and without lists, how a river shapes the valley it runs through over thousands of years, from "
            "the first trickle of melting snow high in the mountains to the wide slow bends near the sea, "
            "and what the people who live beside it notice from one season to the next.")


def complete(serve: Serve, background: bool = False) -> str:
    """One greedy completion of REPEATED; its request id once it has ended."""
    answer = httpx.post(f"{serve.base}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": REPEATED, "temperature": 0, "max_tokens": ANSWER_TOKENS, "ignore_eos": True,
        "background": background})
    assert answer.status_code == (202 if background else 200), answer.text
    request_id = answer.json()["id"] if background else answer.headers["x-request-id"]
    wait_until(lambda: httpx.get(f"{serve.base}/v1/requests/{request_id}", timeout=10).json()["status"] == "finished",
               "the answer", 300)
    return request_id


def answer_ids(serve: Serve, request_id: str) -> list[str]:
    client = serve.redis()
    try:
        return [i for _, f in client.xrange(K.out(request_id)) if f["type"] == "token" for i in f["ids"].split(",") if i]
    finally:
        client.close()


def read_line(serve: Serve, request_id: str) -> str:
    """The worker's log line for the slot it gave the request: `[pid] ... N cached`."""
    return next(line for line in serve.log.read_text().splitlines() if f"<- {request_id} " in line)


def test_a_repeated_request_gives_the_same_answer_cold_cached_batched_and_on_either_worker(serve: Serve):
    """Greedy: the same token ids however the prompt reached the cache (read cold, or its first
    block found cached in the slot), alone or beside another answer, on either worker."""
    # An earlier test of this module may have killed a worker that serve is still restarting.
    wait_until(lambda: len(serve.worker_pids()) == 2, "both workers back", 240)
    one, other = serve.worker_pids()
    os.kill(other, signal.SIGSTOP)  # idle, holding no claim: `one` takes every request meanwhile
    try:
        cold = complete(serve)
        cached = complete(serve, background=True)
        with_another = ask_all_in_background(serve, [REPEATED, "Beside it: name three colours of the sky."])
    finally:
        os.kill(other, signal.SIGCONT)
    os.kill(one, signal.SIGSTOP)
    try:
        elsewhere = complete(serve, background=True)
    finally:
        os.kill(one, signal.SIGCONT)
    reference = answer_ids(serve, cold)
    assert len(reference) == ANSWER_TOKENS
    for request_id in (cached, with_another, elsewhere):
        assert answer_ids(serve, request_id) == reference, read_line(serve, request_id)
    assert f"[{one}]" in read_line(serve, cold) and " 0 cached" in read_line(serve, cold)
    assert f"[{one}]" in read_line(serve, cached) and " 64 cached" in read_line(serve, cached)
    assert f"[{one}]" in read_line(serve, with_another) and " 64 cached" in read_line(serve, with_another)
    assert f"[{other}]" in read_line(serve, elsewhere) and " 0 cached" in read_line(serve, elsewhere)


def ask_all_in_background(serve: Serve, prompts: list[str]) -> str:
    """The prompts sent at once in the background (batched on one worker); the first's request id
    once all have ended."""
    ids = []
    for prompt in prompts:
        answer = httpx.post(f"{serve.base}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": ANSWER_TOKENS, "ignore_eos": True,
            "background": True})
        assert answer.status_code == 202, answer.text
        ids.append(answer.json()["id"])
    wait_until(lambda: all(httpx.get(f"{serve.base}/v1/requests/{i}", timeout=10).json()["status"] == "finished"
                           for i in ids), "the answers", 300)
    return ids[0]
