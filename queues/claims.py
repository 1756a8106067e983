"""The worker's side of the queue: look at the head, claim with a lease, report each step (its
tokens, lease renewals, give-ways, cancels) in one fenced round trip, finish, and give back
claims whose worker stopped renewing them. Every write about a request passes the fence: the
request hash must still name this worker and this claim (queues/lua/_lib.lua `owns`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import redis

from queues import metrics, scripts
from queues.connect import UNAVAILABLE
from queues.keys import Keys, models_key
from queues.lifecycle import RequestStatus
from queues.records import Done, Event, Failed, QueuedRequest, Token, event_fields, parse_event, text
from queues.worker_state import WorkerState

__all__ = ["UNAVAILABLE", "Claimed", "Claims", "Held", "Resumed", "Verdict", "Waiting"]


@dataclass(frozen=True)
class Waiting:
    """One entry at the head of the waiting queue, as the scheduler sees it."""

    member: str
    id: str
    priority: int
    seq: int  # arrival number


@dataclass(frozen=True)
class Claimed:
    request: QueuedRequest
    attempts: int  # > 1: it ran before on a worker that died or handed it back
    claim_seq: int  # the fence: this claim's number, unique per model


@dataclass(frozen=True)
class Resumed:
    """What an earlier attempt already streamed: the client has these, so they are not redone."""

    token_ids: list[int]
    text: str


@dataclass
class Held:
    """One request this worker holds, as one step reports it."""

    id: str
    claim_seq: int
    priority: int
    generated: int  # tokens produced so far, earlier attempts included
    tokens: list[Token] = field(default_factory=list)  # this step's events
    slot: int | None = None  # set on the step it was claimed: where it went
    first_token: bool = False  # its read ended this step
    gave_way_to: str | None = None  # its read gave way this step


@dataclass(frozen=True)
class Verdict:
    """report's answer: claims this worker lost (drop them, write nothing more) and requests whose
    client asked to cancel."""

    lost: frozenset[str]
    cancelled: frozenset[str]


class Claims:
    def __init__(
        self,
        client: redis.Redis,
        model: str,
        worker_id: str,
        *,
        lease_ms: int = 15_000,
        retention_s: int = 3600,
        max_attempts: int = 3,
    ) -> None:
        self.client = client
        self.keys = Keys(model)
        self.model = model
        self.worker_id = worker_id
        self.lease_ms = lease_ms
        self.retention_s = retention_s
        self.max_attempts = max_attempts  # claims a request may lose to dead workers before it fails
        self._scripts = scripts.register(client)

    def head(self, count: int = 1) -> list[Waiting]:
        """The first `count` waiting requests in service order. Their priority comes from their
        hashes: with aging the score no longer says it."""
        members = [text(m) for m in self.client.zrange(self.keys.waiting, 0, count - 1)]
        if not members:
            return []
        pipe = self.client.pipeline(transaction=False)
        for member in members:
            pipe.hget(self.keys.req(member.partition(":")[2]), "priority")
        return [_waiting(member, priority) for member, priority in zip(members, pipe.execute())]

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

    def claim(self, waiting: Waiting, now_ms: int) -> Claimed | None:
        """None when another worker took it first, or when its queue deadline had passed (it
        expired instead: no worker ever claims it)."""
        k = self.keys
        flat = self._scripts["claim"](
            keys=[k.waiting, k.running, k.req(waiting.id), k.claims, k.deadlines, k.out(waiting.id), k.metrics],
            args=[waiting.member, waiting.id, self.worker_id, now_ms, now_ms + self.lease_ms, self.retention_s],
        )
        if flat is None or flat == 0:
            return None
        fields = {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}
        return Claimed(QueuedRequest.from_hash(fields), int(fields["attempts"]), int(fields["claim_seq"]))

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

    def report(self, held: Sequence[Held], now_ms: int) -> Verdict:
        """One round trip per step (report.lua), fenced per request."""
        if not held:
            return Verdict(frozenset(), frozenset())
        k = self.keys
        keys = [k.running, k.metrics]
        args: list = [self.worker_id, now_ms, now_ms + self.lease_ms, len(held)]
        for h in held:
            keys += [k.req(h.id), k.out(h.id)]
            args += [h.id, h.claim_seq, h.generated, "" if h.slot is None else h.slot, int(h.first_token),
                     h.gave_way_to or "", h.priority, len(h.tokens)]
            for token in h.tokens:
                fields = event_fields(token)
                args += [fields["text"], fields["ids"]]
        codes = self._scripts["report"](keys=keys, args=args)
        return Verdict(frozenset(h.id for h, c in zip(held, codes) if int(c) == 0),
                       frozenset(h.id for h, c in zip(held, codes) if int(c) == 2))

    def finish(self, request_id: str, claim_seq: int, event: Event | None, status: RequestStatus,
               completion_tokens: int, now_ms: int) -> bool:
        """End a request: `event` is its last stream entry (None for a cancel: a `cancelled` error). False when this
        worker no longer holds that claim: nothing was written. Counted in the model's metrics
        hash in the same script (queues/metrics.py)."""
        k = self.keys
        if event is None:  # a reader that re-attached (or the client that asked) learns it ended
            event = Failed("cancelled", RequestStatus.CANCELLED.value)
        if isinstance(event, Done):
            reason = event.finish_reason
        else:
            reason = event.code if isinstance(event, Failed) else RequestStatus.CANCELLED.value
        args: list = [request_id, self.worker_id, claim_seq, status.value, now_ms, self.retention_s,
                      completion_tokens, reason, metrics.bounds_arg()]
        if event is not None:
            for name, value in event_fields(event).items():
                args += [name, value]
        done = self._scripts["finish"](
            keys=[k.running, k.req(request_id), k.out(request_id), k.metrics], args=args
        )
        return bool(done)

    def _requeue(self, request_id: str, now_ms: int, owner: str = "", claim_seq: int | None = None,
                 lost: bool = True) -> int:
        k = self.keys
        return int(self._scripts["requeue"](
            keys=[k.running, k.waiting, k.req(request_id), k.out(request_id), k.metrics],
            args=[request_id, now_ms, self.max_attempts, self.retention_s, owner,
                  "" if claim_seq is None else claim_seq, int(lost)],
        ))

    def expire_overdue(self, now_ms: int, limit: int = 256) -> list[str]:
        """The deadline sweep: waiting requests whose queue_timeout passed leave the queue with a
        queue_timeout error. Any worker runs it (so does the API for its own client's request):
        expiry needs no particular process alive."""
        due = self.client.zrangebyscore(self.keys.deadlines, "-inf", now_ms, start=0, num=limit)
        return [text(rid) for rid in due if expire(self._scripts, self.keys, text(rid), now_ms, self.retention_s)]

    def requeue_expired(self, now_ms: int) -> list[str]:
        """Give back claims whose lease ran out (their worker died or froze): original place in the
        queue, or failed as worker_lost once a request has lost `max_attempts` claims."""
        return [text(rid) for rid in self.client.zrangebyscore(self.keys.running, "-inf", now_ms)
                if self._requeue(text(rid), now_ms)]

    def give_back(self, held: Iterable[tuple[str, int]], now_ms: int, lost: bool = False) -> list[str]:
        """This worker hands back its claims (request id, claim_seq) at once, in their original
        places; what they already streamed is kept, and the next worker resumes after it. A clean
        stop is not counted as lost; a step that broke is (`lost`). A claim it no longer holds is
        left alone."""
        return [rid for rid, seq in held if self._requeue(rid, now_ms, self.worker_id, seq, lost) == 1]

    def reclaim_from_dead(self, is_dead: Callable[[str], bool], now_ms: int) -> list[str]:
        """Claims held by workers known to be dead (same host, no such process) go back now
        rather than when their leases run out. Counted as lost. A dead worker leaves the workers
        set too, holding claims or not (its leases may have run out before anyone looked)."""
        running = [text(r) for r in self.client.zrange(self.keys.running, 0, -1)]
        known = {text(w) for w in self.client.zrange(self.keys.workers, 0, -1)}
        owners: list[str] = []
        if running:
            pipe = self.client.pipeline(transaction=False)
            for rid in running:
                pipe.hget(self.keys.req(rid), "worker")
            owners = [text(w) if w else "" for w in pipe.execute()]
        dead = {w for w in known | set(owners) if w and w != self.worker_id and is_dead(w)}
        back = [rid for rid, w in zip(running, owners) if w in dead and self._requeue(rid, now_ms, w)]
        for worker in dead:
            self._forget_worker(worker)
        return back

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

    def leave(self) -> None:
        """A clean stop: the worker's hash goes at once rather than when its TTL ends."""
        self._forget_worker(self.worker_id)

    def _forget_worker(self, worker_id: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.worker(worker_id))
        pipe.zrem(self.keys.workers, worker_id)
        pipe.zrem(self.keys.idle, worker_id)
        pipe.execute()

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until an enqueue pushes a wake-up (or the timeout passes)."""
        self.client.blpop([self.keys.wake], timeout=timeout_s)


def _waiting(member: str, priority: str | bytes | None) -> Waiting:
    seq, _, request_id = member.partition(":")
    return Waiting(member, request_id, int(priority or 0), int(seq))


def expire(registered: dict, keys: Keys, request_id: str, now_ms: int, retention_s: int):  # noqa: ANN201
    """expire.lua for one request (1: it expired now); awaitable with an asyncio client."""
    return registered["expire"](
        keys=[keys.waiting, keys.deadlines, keys.req(request_id), keys.out(request_id), keys.metrics],
        args=[request_id, now_ms, retention_s],
    )
