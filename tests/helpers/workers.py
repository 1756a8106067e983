"""A real worker loop over the fake engine on its virtual clock, and a log of what it reads."""

from __future__ import annotations

from engine.fake import FakeEngine
from queues.claims import Claims
from workers.loop import Worker
from workers.scheduler import Policy

from tests.helpers.queue import MODEL


def make_worker(redis_client, *, slots: int = 2, chunk: int = 8, worker_id: str = "w1", policy: Policy = Policy(),
                engine_type: type[FakeEngine] = FakeEngine, **engine_kw) -> Worker:
    engine = engine_type(num_slots=slots, **engine_kw)
    claims = Claims(redis_client, MODEL, worker_id, lease_ms=1000)
    worker = Worker(engine, claims, engine.tokenizer, prefill_chunk=chunk, policy=policy, clock=engine.clock)
    worker.announce(engine.clock())  # as run() does: the queue's aging policy, for enqueues from now on
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
