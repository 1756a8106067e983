from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from engine.fake import FakeEngine
from queues.claims import Claims
from queues.intake import Intake
from queues.records import QueuedRequest
from workers.loop import Worker
from workers.scheduler import Policy

MODEL = "fake"


class Submit:
    """Enqueue through the API's own path (Intake), from synchronous tests."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    def __call__(self, rid: str, priority: int = 0, prompt_len: int = 4, max_tokens: int = 3,
                 prompt: list[int] | None = None, **kw) -> None:
        async def go() -> None:
            client = aioredis.Redis.from_url(self.redis_url)
            try:
                await Intake(client, MODEL).enqueue(
                    QueuedRequest(id=rid, priority=priority, prompt=prompt or list(range(1, prompt_len + 1)),
                                  max_tokens=max_tokens, **kw)
                )
            finally:
                await client.aclose()

        asyncio.run(go())


@pytest.fixture
def submit(redis_url: str) -> Submit:
    return Submit(redis_url)


def make_worker(redis_client, *, slots: int = 2, chunk: int = 8, worker_id: str = "w1", policy: Policy = Policy(),
                **engine_kw) -> Worker:
    engine = FakeEngine(num_slots=slots, **engine_kw)
    claims = Claims(redis_client, MODEL, worker_id, lease_ms=1000)
    worker = Worker(engine, claims, engine.tokenizer, prefill_chunk=chunk, policy=policy, clock=engine.clock)
    spy_on_reads(worker)
    return worker


def spy_on_reads(worker: Worker) -> None:
    """worker.read_log: (request id, tokens) of every prompt chunk, in the order read."""
    worker.read_log = []
    read = worker.engine.read

    def logged(slot: int, tokens, sample: bool):
        worker.read_log.append((worker.slots[slot].request.id, len(tokens)))
        return read(slot, tokens, sample)

    worker.engine.read = logged


def run_until_idle(worker: Worker, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not worker.step():
            return
    raise AssertionError("the worker never went idle")
