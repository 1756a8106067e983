"""Who serves a model: each worker's heartbeat and published state, its idle signal, the queue
policy the workers publish, and the reads of all that (/health, /v1/models, the API's fit
check). Claims on requests are queues/claims.py; this is the fleet they belong to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import redis
import redis.asyncio as aioredis

from queues import scripts
from queues.keys import Keys, models_key
from queues.records import text
from queues.worker_state import WorkerState


@dataclass(frozen=True)
class Peer:
    """Another worker that could take a newcomer now (free unreserved slot, free lines: the idle
    set), with the prefix affinity keys it advertises and whether it holds a head back for memory."""

    worker: str
    prefixes: frozenset[str] = frozenset()
    waits_for_memory: bool = False


class Membership:
    """One worker's membership of its model's fleet (sync client)."""

    def __init__(self, client: redis.Redis, model: str, worker_id: str) -> None:
        self.client = client
        self.keys = Keys(model)
        self.model = model
        self.worker_id = worker_id
        self._scripts = scripts.register(client, ("peers",))

    def heartbeat(self, state: WorkerState, now_ms: int, ttl_s: int) -> None:
        k = self.keys
        key = k.worker(self.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(key)
        pipe.hset(key, mapping={**state.to_hash(), "heartbeat_ms": now_ms})
        pipe.expire(key, ttl_s)
        pipe.zadd(k.workers, {self.worker_id: now_ms})
        pipe.zadd(models_key(), {self.model: now_ms})
        pipe.execute()

    def set_aging(self, aging_s: float | None, now_ms: int) -> float | None:
        """Publish this worker's --aging-s for enqueue.lua (None: no aging); the epoch (the zero
        of aged scores) is set once and kept, so scores stay comparable across restarts. Returns
        the value there before (workers of one model should agree)."""
        key = self.keys.policy
        before = self.client.hget(key, "aging_s")
        if aging_s is None:
            self.client.hdel(key, "aging_s")
        else:
            self.client.hsetnx(key, "aging_epoch_ms", now_ms)
            self.client.hset(key, "aging_s", repr(float(aging_s)))
        return float(before) if before else None

    def set_idle(self, idle: bool, now_ms: int) -> None:
        if idle:
            self.client.zadd(self.keys.idle, {self.worker_id: now_ms})
        else:
            self.client.zrem(self.keys.idle, self.worker_id)

    def idle_elsewhere(self, now_ms: int, within_ms: int) -> bool:
        """Another live worker has a free slot and free lines."""
        others = self.client.zrangebyscore(self.keys.idle, now_ms - within_ms, "+inf")
        return any(text(w) != self.worker_id for w in others)

    def peers(self, now_ms: int, within_ms: int) -> list[Peer]:
        """The other live workers in the idle set, with what they advertise (peers.lua: one round
        trip). Non-empty exactly when idle_elsewhere is true."""
        flat = scripts.run(self._scripts, scripts.peers(self.keys, now_ms - within_ms, self.worker_id))
        return [Peer(text(flat[i]), frozenset(p for p in text(flat[i + 1] or "").split(",") if p),
                     bool(flat[i + 2])) for i in range(0, len(flat), 3)]

    def wake(self, worker_id: str, ttl_ms: int = 2000) -> None:
        """Wake that worker if it blocks for work (Claims.wait_for_work); one entry, gone soon if
        it was not blocking."""
        key = self.keys.wake_worker(worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(key, self.worker_id)
        pipe.ltrim(key, 0, 0)
        pipe.pexpire(key, ttl_ms)
        pipe.execute()

    def forget_dead(self, is_dead: Callable[[str], bool]) -> list[str]:
        """Workers of the set known to be dead (same host, no such process) leave it, with their
        hashes and idle entries; their claims are queues/claims.py `reclaim_from_dead`."""
        dead = [w for w in (text(w) for w in self.client.zrange(self.keys.workers, 0, -1))
                if w != self.worker_id and is_dead(w)]
        for worker in dead:
            self._forget(worker)
        return dead

    def leave(self) -> None:
        """A clean stop: the worker's hash goes at once rather than when its TTL ends."""
        self._forget(self.worker_id)

    def _forget(self, worker_id: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.worker(worker_id))
        pipe.zrem(self.keys.workers, worker_id)
        pipe.zrem(self.keys.idle, worker_id)
        pipe.execute()


# ---- what the API reads of the fleet (asyncio client) -----------------------------------------


async def known_models(client: aioredis.Redis) -> list[str]:
    """Every model a worker ever served on this Redis."""
    return [text(m) for m in await client.zrange(models_key(), 0, -1)]


async def queue_health(client: aioredis.Redis, model: str) -> tuple[int, int | None]:
    """(requests waiting, newest worker heartbeat in ms or None) for /health: one round trip."""
    pipe = client.pipeline(transaction=False)
    pipe.zcard(Keys(model).waiting)
    pipe.zscore(models_key(), model)
    waiting, beat = await pipe.execute()
    return int(waiting), None if beat is None else int(beat)


async def live_workers(client: aioredis.Redis, model: str, now_ms: int, within_ms: int) -> int:
    """Workers of `model` with a heartbeat in the last `within_ms` (a worker that stopped
    cleanly has left the set already)."""
    return int(await client.zcount(Keys(model).workers, now_ms - within_ms, "+inf"))


async def live_states(client: aioredis.Redis, model: str, now_ms: int, within_ms: int) -> list[tuple[str, WorkerState]]:
    """(worker id, what it published) for each worker of `model` with a heartbeat in the last
    `within_ms` whose hash still exists."""
    k = Keys(model)
    ids = [text(wid) for wid in await client.zrangebyscore(k.workers, now_ms - within_ms, "+inf")]
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    for wid in ids:
        pipe.hgetall(k.worker(wid))
    hashes = await pipe.execute()
    return [(wid, WorkerState.from_hash({text(a): text(b) for a, b in h.items()})) for wid, h in zip(ids, hashes) if h]


async def live_facts(client: aioredis.Redis, model: str, now_ms: int, within_ms: int,
                     ) -> tuple[int | None, int | None, int | None]:
    """(smallest ctx, smallest KV pool in tokens, most slots) the live workers of `model` publish,
    in two round trips; each None when no live worker has said."""
    k = Keys(model)
    ids = await client.zrangebyscore(k.workers, now_ms - within_ms, "+inf")
    if not ids:
        return None, None, None
    pipe = client.pipeline(transaction=False)
    for wid in ids:
        pipe.hmget(k.worker(text(wid)), "ctx", "blocks_total", "kv_block", "slots_total")
    ctxs, pools, slots = [], [], []
    for ctx, blocks, block, total in await pipe.execute():
        if ctx and text(ctx).isdigit() and int(ctx) > 0:
            ctxs.append(int(ctx))
        if blocks and block and text(blocks).isdigit() and text(block).isdigit() and int(blocks) * int(block) > 0:
            pools.append(int(blocks) * int(block))
        if total and text(total).isdigit() and int(total) > 0:
            slots.append(int(total))
    return min(ctxs, default=None), min(pools, default=None), max(slots, default=None)
