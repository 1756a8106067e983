"""A read-only view of the queues for operators (`strata queues`): what waits, in service order,
and what each worker is doing. Reads only; never changes a key."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from queues.keys import Keys, models_key
from queues.records import text


@dataclass(frozen=True)
class WaitingView:
    id: str
    priority: int
    seq: int
    age_s: float
    prompt_tokens: int
    key_name: str


@dataclass(frozen=True)
class WorkerView:
    id: str
    device: str
    slots_busy: int
    slots_total: int
    reading: str
    reading_priority: int | None
    reading_progress: int
    reading_prompt_tokens: int
    parked: list[str]
    give_ways: int
    heartbeat_age_s: float


@dataclass
class ModelView:
    name: str
    waiting_total: int
    running: int
    waiting: list[WaitingView] = field(default_factory=list)
    workers: list[WorkerView] = field(default_factory=list)


def snapshot(client: redis.Redis, now_ms: int, limit: int = 50) -> list[ModelView]:
    views = []
    for model in client.zrange(models_key(), 0, -1):
        views.append(model_view(client, text(model), now_ms, limit))
    return views


def model_view(client: redis.Redis, model: str, now_ms: int, limit: int = 50) -> ModelView:
    k = Keys(model)
    pipe = client.pipeline(transaction=False)
    pipe.zcard(k.waiting)
    pipe.zcard(k.running)
    pipe.zrange(k.waiting, 0, limit - 1, withscores=True)
    pipe.zrange(k.workers, 0, -1)
    waiting_total, running, head, workers = pipe.execute()
    view = ModelView(model, waiting_total, running)
    members = [(text(m), s) for m, s in head]
    pipe = client.pipeline(transaction=False)
    for member, _score in members:
        pipe.hmget(k.req(member.partition(":")[2]), "enqueued_ms", "prompt_tokens", "key_name")
    for worker in workers:
        pipe.hgetall(k.worker(text(worker)))
    replies = pipe.execute()
    for (member, score), (enqueued, prompt_tokens, key_name) in zip(members, replies[: len(members)]):
        seq, _, rid = member.partition(":")
        view.waiting.append(WaitingView(
            rid, int(-score), int(seq), (now_ms - int(enqueued or now_ms)) / 1000,
            int(prompt_tokens or 0), text(key_name) if key_name else ""))
    for worker, h in zip(workers, replies[len(members):]):
        h = {text(a): text(b) for a, b in h.items()}
        if not h:
            continue  # its hash expired: the worker is gone
        view.workers.append(WorkerView(
            text(worker), h.get("device", ""), int(h.get("slots_busy", 0)), int(h.get("slots_total", 0)),
            h.get("reading", ""), int(h["reading_priority"]) if h.get("reading_priority") else None,
            int(h.get("reading_progress", 0)), int(h.get("reading_prompt_tokens", 0)),
            [p for p in h.get("parked", "").split(",") if p], int(h.get("give_ways", 0)),
            (now_ms - int(h.get("heartbeat_ms", now_ms))) / 1000))
    return view
