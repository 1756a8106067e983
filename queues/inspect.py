"""A read-only view of the queues for operators (`strata queues`): what waits, in service order,
and what each worker is doing. Reads only; never changes a key."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from queues.keys import Keys, Member, models_key
from queues.records import decoded, text
from queues.worker_state import WorkerState


@dataclass(frozen=True)
class WaitingView:
    id: str
    priority: int
    seq: int
    age_s: float
    prompt_tokens: int
    key_name: str


@dataclass
class ModelView:
    name: str
    waiting_total: int
    running: int
    now_ms: int  # when it was read: ages are relative to it
    waiting: list[WaitingView] = field(default_factory=list)
    workers: list[tuple[str, WorkerState]] = field(default_factory=list)  # (worker id, what it published)


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
    view = ModelView(model, waiting_total, running, now_ms)
    members = [(text(m), s) for m, s in head]
    pipe = client.pipeline(transaction=False)
    for member, _score in members:
        pipe.hmget(k.req(Member.parse(member).id), "enqueued_ms", "prompt_tokens", "key_name", "priority")
    for worker in workers:
        pipe.hgetall(k.worker(text(worker)))
    replies = pipe.execute()
    for (member, _score), (enqueued, prompt_tokens, key_name, priority) in zip(members, replies[: len(members)]):
        seq, rid = Member.parse(member)
        view.waiting.append(WaitingView(
            rid, int(priority or 0), int(seq), (now_ms - int(enqueued or now_ms)) / 1000,
            int(prompt_tokens or 0), text(key_name) if key_name else ""))
    for worker, h in zip(workers, replies[len(members):]):
        if h:  # else its hash expired: the worker is gone
            view.workers.append((text(worker), WorkerState.from_hash(decoded(h))))
    return view
