"""The worker's side of the queue: look at the head, claim into a slot with a lease, report
each step's tokens, notice cancels, renew leases, finish, and give back expired claims."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import redis

from queues import metrics, scripts
from queues.keys import Keys, models_key
from queues.records import Done, Event, Failed, QueuedRequest, Token, event_fields, parse_event, text

# Redis is gone for now (restarting, network): the caller waits and tries again.
UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


@dataclass(frozen=True)
class Waiting:
    """One entry at the head of the waiting queue, as the scheduler sees it."""

    member: str
    id: str
    priority: int
    seq: int


@dataclass(frozen=True)
class Claimed:
    request: QueuedRequest
    attempts: int  # > 1: it ran before on a worker that died
    claim_seq: int


@dataclass(frozen=True)
class Resumed:
    """What an earlier attempt already streamed: the client has these, so they are not redone."""

    token_ids: list[int]
    text: str


class Claims:
    def __init__(
        self,
        client: redis.Redis,
        model: str,
        worker_id: str,
        *,
        lease_ms: int = 15_000,
        retention_s: int = 3600,
    ) -> None:
        self.client = client
        self.keys = Keys(model)
        self.model = model
        self.worker_id = worker_id
        self.lease_ms = lease_ms
        self.retention_s = retention_s
        self._scripts = scripts.register(client)

    def head(self, count: int = 1) -> list[Waiting]:
        entries = self.client.zrange(self.keys.waiting, 0, count - 1, withscores=True)
        return [_waiting(text(member), score) for member, score in entries]

    def claim(self, waiting: Waiting, slot: int, now_ms: int) -> Claimed | None:
        """None when another worker took it first."""
        k = self.keys
        flat = self._scripts["claim"](
            keys=[k.waiting, k.running, k.req(waiting.id), k.claims],
            args=[waiting.member, waiting.id, self.worker_id, slot, now_ms, now_ms + self.lease_ms],
        )
        if flat is None:
            return None
        fields = {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}
        return Claimed(QueuedRequest.from_hash(fields), int(fields["attempts"]), int(fields["claim_seq"]))

    def assign(self, request_id: str, slot: int) -> None:
        """The slot chosen once the prompt was known (claim records a provisional one)."""
        self.client.hset(self.keys.req(request_id), "slot", slot)

    def note_give_way(self, parked_id: str, to_id: str, now_ms: int) -> None:
        """A read gave way at a chunk boundary: counted on its hash for operators."""
        key = self.keys.req(parked_id)
        priority = text(self.client.hget(key, "priority") or "0")
        pipe = self.client.pipeline(transaction=False)
        pipe.hincrby(key, "yields", 1)
        pipe.hset(key, mapping={"parked_ms": now_ms, "gave_way_to": to_id})
        pipe.hincrby(self.keys.metrics, f"give_ways:{priority}", 1)  # see queues/metrics.py
        pipe.execute()

    def set_idle(self, idle: bool, now_ms: int) -> None:
        if idle:
            self.client.zadd(self.keys.idle, {self.worker_id: now_ms})
        else:
            self.client.zrem(self.keys.idle, self.worker_id)

    def idle_elsewhere(self, now_ms: int, within_ms: int) -> bool:
        """Another live worker has a free slot and free lines."""
        others = self.client.zrangebyscore(self.keys.idle, now_ms - within_ms, "+inf")
        return any(text(w) != self.worker_id for w in others)

    def resumed(self, request_id: str) -> Resumed:
        ids: list[int] = []
        pieces = []
        for _entry, fields in self.client.xrange(self.keys.out(request_id)):
            event = parse_event({text(a): text(b) for a, b in fields.items()})
            if isinstance(event, Token):
                ids.extend(event.token_ids)
                pieces.append(event.text)
        return Resumed(ids, "".join(pieces))

    def report(
        self, tokens: list[tuple[str, Token]], running: list[str], now_ms: int, started: Sequence[str] = ()
    ) -> set[str]:
        """One round trip per step: stream the step's tokens, note the first token of the requests
        whose read ended (`started`), renew every lease, and return the running requests whose
        client asked to cancel."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        for request_id, token in tokens:
            pipe.xadd(k.out(request_id), event_fields(token))
        for request_id in started:
            pipe.hsetnx(k.req(request_id), "first_token_ms", now_ms)  # an earlier attempt's stays
        if running:
            pipe.zadd(k.running, {rid: now_ms + self.lease_ms for rid in running}, xx=True)
            for request_id in running:
                pipe.hget(k.req(request_id), "cancel_requested_ms")
        replies = pipe.execute()
        flags = replies[len(replies) - len(running):] if running else []
        return {rid for rid, flag in zip(running, flags) if flag}

    def finish(self, request_id: str, event: Event | None, status: str, completion_tokens: int, now_ms: int) -> bool:
        """End a request: `event` is its last stream entry (None for a cancel). False when this
        worker no longer owns it (its lease ran out and it was requeued). Counted in the model's
        metrics hash in the same script (queues/metrics.py)."""
        k = self.keys
        reason = event.finish_reason if isinstance(event, Done) else (event.code if isinstance(event, Failed) else "cancelled")
        args: list = [request_id, self.worker_id, status, now_ms, self.retention_s, completion_tokens, reason,
                      metrics.bounds_arg()]
        if event is not None:
            for field, value in event_fields(event).items():
                args += [field, value]
        done = self._scripts["finish"](
            keys=[k.running, k.req(request_id), k.out(request_id), k.metrics], args=args
        )
        return bool(done)

    def requeue_expired(self, now_ms: int) -> list[str]:
        """Give back claims whose lease ran out (their worker died): original place in the queue."""
        k = self.keys
        back = []
        for rid in self.client.zrangebyscore(k.running, "-inf", now_ms):
            rid = text(rid)
            if self._scripts["requeue"](keys=[k.running, k.waiting, k.req(rid)], args=[rid, now_ms]):
                back.append(rid)
        return back

    def give_back(self, request_ids: list[str], now_ms: int) -> list[str]:
        """A worker stopping cleanly hands its requests back at once, in their original places;
        what they already streamed is kept, and the next worker resumes after it."""
        if request_ids:
            self.client.zadd(self.keys.running, {rid: now_ms - 1 for rid in request_ids}, xx=True)
        return [rid for rid in self.requeue_expired(now_ms) if rid in request_ids]

    def heartbeat(self, fields: dict[str, str | int], now_ms: int, ttl_s: int) -> None:
        k = self.keys
        key = k.worker(self.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(key)
        pipe.hset(key, mapping={**fields, "heartbeat_ms": now_ms})
        pipe.expire(key, ttl_s)
        pipe.zadd(k.workers, {self.worker_id: now_ms})
        pipe.zadd(models_key(), {self.model: now_ms})
        pipe.execute()

    def leave(self) -> None:
        """A clean stop: the worker's hash goes at once rather than when its TTL ends."""
        self.client.delete(self.keys.worker(self.worker_id))
        self.client.zrem(self.keys.workers, self.worker_id)
        self.client.zrem(self.keys.idle, self.worker_id)

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until an enqueue pushes a wake-up (or the timeout passes)."""
        self.client.blpop([self.keys.wake], timeout=timeout_s)


def _waiting(member: str, score: float) -> Waiting:
    seq, _, request_id = member.partition(":")
    return Waiting(member, request_id, int(-score), int(seq))
