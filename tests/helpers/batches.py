"""The batch tests' stack: the API (uvicorn, in-process thread, a one-token-per-character
tokenizer), a fake-engine worker (workers.loop.Worker over FakeEngine, in a thread, wall clock,
a real pause per decode step so lines queue up), and `strata batch-worker` (a real RQ worker)
as a subprocess of its own session (so a kill takes every process it started)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import redis
import torch

from api.app import create_app
from api.settings import ApiSettings
from engine.fake import FakeEngine
from engine.protocol import SamplingParams
from engine.sampling import SlotSampler, sample_tokens
from queues.claims import Claims
from queues.keys import Keys
from tests.helpers.http import serve_app
from workers.loop import Worker, wall_ms

MODEL = "tiny"
FINAL = ("completed", "failed", "expired", "cancelled")


class FakeTokenizer:
    """One token per character."""

    eos_token_ids = frozenset({0})

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 997 + 1 for c in text]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


@dataclass
class SlowEngine(FakeEngine):
    """The fake engine, taking real time per decode step (so a batch is still running when an
    interactive request arrives), choosing each token with the real engine's sampler
    (engine/sampling.py) over logits made from what the slot holds: a request's seed,
    temperature, top_p and top_k act, and fail, as they would on a GPU."""

    step_s: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._samplers = [SlotSampler.start(SamplingParams(temperature=0.0)) for _ in range(self.num_slots)]

    def begin(self, slot, params, keep=0):  # noqa: ANN001
        self._samplers[slot] = SlotSampler.start(params)
        super().begin(slot, params, keep)

    def decode(self, slots, tokens):  # noqa: ANN001
        time.sleep(self.step_s)
        return super().decode(slots, tokens)

    def _next(self, slot: int) -> int:
        # logits: [1, vocab], a fixed function of what the slot holds; EOS masked (the fake never ends by itself)
        holds = sum(self._cache[slot]) + len(self._cache[slot])
        logits = torch.sin(torch.arange(self.vocab, dtype=torch.float32) * (holds % 997 + 1)) * 8
        logits[self.eos_token_id] = float("-inf")
        return sample_tokens(logits[None], [self._samplers[slot]], frozenset())[0]


@contextmanager
def serve_api(settings: ApiSettings) -> Iterator[str]:
    with serve_app(create_app(settings, tokenizer=FakeTokenizer())) as base_url:
        yield base_url


@contextmanager
def fake_worker(redis_url: str, slots: int, step_s: float) -> Iterator[Worker]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    engine = SlowEngine(num_slots=slots, step_s=step_s)
    worker = Worker(engine, Claims(client, MODEL, "w1", lease_ms=10_000), engine.tokenizer, prefill_chunk=64,
                    clock=wall_ms, idle_wait_s=0.05)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stopping = True
        thread.join(10)
        client.close()


class BatchWorkerProcess:
    """`strata batch-worker` in its own session: kill() is a machine dying (every process in it)."""

    def __init__(self, redis_url: str, **settings: object) -> None:
        env = {**os.environ, "STRATA_REDIS_URL": redis_url, "STRATA_BATCH_SWEEP_S": "0.3",
               "STRATA_BATCH_LEASE_MS": "1500", "STRATA_BATCH_READ_BLOCK_MS": "50"}
        env.update({f"STRATA_{k.upper()}": str(v) for k, v in settings.items()})
        env.pop("REDIS_URL", None)
        self.process = subprocess.Popen([sys.executable, "-m", "strata", "batch-worker"], env=env,
                                        start_new_session=True, stdout=subprocess.DEVNULL)

    def session(self) -> list[int]:
        """The processes of its session still running (a child may have left its process group)."""
        alive = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    state = stat.read().rpartition(")")[2].split()[0]
                if state != "Z" and os.getsid(int(entry)) == self.process.pid:
                    alive.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
        return alive

    def kill(self) -> None:
        while alive := self.session():
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


@dataclass
class Stack:
    base_url: str
    redis_url: str
    redis: redis.Redis
    http: httpx.Client
    keys: Keys = Keys(MODEL)

    def upload(self, lines: list[dict] | bytes, name: str = "in.jsonl") -> httpx.Response:
        content = lines if isinstance(lines, bytes) else "".join(json.dumps(x) + "\n" for x in lines).encode()
        return self.http.post("/v1/files", files={"file": (name, content)}, data={"purpose": "batch"})

    def create(self, file_id: str, endpoint: str = "/v1/chat/completions", **extra: object) -> httpx.Response:
        return self.http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                                   "completion_window": "24h", **extra})

    def submit(self, lines: list[dict], **extra: object) -> dict:
        uploaded = self.upload(lines)
        assert uploaded.status_code == 200, uploaded.text
        created = self.create(uploaded.json()["id"], **extra)
        assert created.status_code == 200, created.text
        return created.json()

    def batch(self, batch_id: str) -> dict:
        return self.http.get(f"/v1/batches/{batch_id}").json()

    def wait(self, batch_id: str, until: Callable[[dict], bool], timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while not until(batch := self.batch(batch_id)):
            assert time.monotonic() < deadline, f"timed out; batch is {batch}"
            time.sleep(0.05)
        return batch

    def wait_final(self, batch_id: str, timeout_s: float = 60) -> dict:
        return self.wait(batch_id, lambda b: b["status"] in FINAL, timeout_s)

    def content(self, file_id: str) -> list[dict]:
        response = self.http.get(f"/v1/files/{file_id}/content")
        assert response.status_code == 200, response.text
        return [json.loads(line) for line in response.text.splitlines()]

    def record(self, request_id: str) -> dict[str, str]:
        return self.redis.hgetall(self.keys.req(request_id))


def chat_lines(count: int, max_tokens: int = 4, prefix: str = "q") -> list[dict]:
    return [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}],
                      "max_tokens": max_tokens, "ignore_eos": True}}
            for i in range(count)]
