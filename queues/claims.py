"""The worker's side of the queue: look at the head, claim with a lease, report each step (its
tokens, lease renewals, give-ways, cancels) in one fenced round trip, finish, and give back
claims whose worker stopped renewing them. Every write about a request passes the fence: the
request hash must still name this worker and this claim (queues/lua/_lib.lua `owns`). The
fleet the worker belongs to (heartbeat, idle signal) is queues/membership.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import redis

from queues import metrics, scripts
from queues.connect import UNAVAILABLE
from queues.keys import Keys, Member
from queues.lifecycle import RequestStatus
from queues.records import Done, Event, QueuedRequest, Token, event_fields, events, text
from queues.scripts import ClaimResult, ExpireResult, FinishResult, ReportResult, RequeueResult

__all__ = ["UNAVAILABLE", "Claimed", "Claims", "Ending", "Held", "Resumed", "Verdict", "Waiting"]


@dataclass(frozen=True)
class Waiting:
    """One entry at the head of the waiting queue, as the scheduler sees it."""

    member: str
    id: str
    priority: int
    seq: int  # arrival number
    n: int = 1  # the slots it takes: one per answer (QueuedRequest.n)
    affinity: str | None = None  # its prompt's prefix affinity key (queues/affinity.py); None: too short

    @classmethod
    def of(cls, member: str, priority: str | bytes | None, n: str | bytes | None = None,
           affinity: str | bytes | None = None) -> "Waiting":
        seq, request_id = Member.parse(member)
        return cls(member, request_id, int(priority or 0), seq, int(n or 1), text(affinity) if affinity else None)


@dataclass(frozen=True)
class Claimed:
    request: QueuedRequest
    attempts: int  # > 1: it ran before on a worker that died or handed it back
    claim_seq: int  # the fence: this claim's number, unique per model


@dataclass(frozen=True)
class Resumed:
    """What an earlier attempt already streamed of one answer: the client has these, so they are
    not redone. `ended`: that answer's Done is in the stream (one of n that finished first)."""

    token_ids: list[int]
    text: str
    ended: bool = False


@dataclass
class Held:
    """One request this worker holds, as one step reports it."""

    id: str
    claim_seq: int
    priority: int
    generated: int  # tokens produced so far, earlier attempts included
    tokens: list[Token | Done] = field(default_factory=list)  # this step's events (Done: one of n answers ended)
    slot: int | None = None  # set on the step it was claimed: where it went
    first_token: bool = False  # its read ended this step
    gave_way_to: str | None = None  # its read gave way this step
    cached_tokens: int | None = None  # set on the step it was claimed: its prompt tokens found in the KV pool


@dataclass(frozen=True)
class Ending:
    """A request that ended in a step, for finish: its last stream entry (None: cancelled)."""

    id: str
    claim_seq: int
    event: Event | None
    status: RequestStatus
    completion_tokens: int


def _claimed(reply: list) -> Claimed | None:
    if ClaimResult(int(reply[0])) is not ClaimResult.CLAIMED:
        return None
    flat = reply[1]
    fields = {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}
    return Claimed(QueuedRequest.from_hash(fields), int(fields["attempts"]), int(fields["claim_seq"]))


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
        flat = scripts.run(self._scripts, scripts.head(self.keys, count))
        return [Waiting.of(text(flat[i]), flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, len(flat), 4)]

    def claim(self, waiting: Waiting, now_ms: int) -> Claimed | None:
        """None when another worker took it first, or when its queue deadline had passed (it
        expired instead: no worker ever claims it)."""
        return self.claim_many([waiting], now_ms)[0]

    def claim_many(self, waiting: Sequence[Waiting], now_ms: int) -> list[Claimed | None]:
        """claim() of each, in order, in one round trip (a step's admissions)."""
        replies = scripts.run_all(self.client, self._scripts, [scripts.claim(
            self.keys, w.member, w.id, self.worker_id, now_ms, now_ms + self.lease_ms, self.retention_s)
            for w in waiting])
        return [_claimed(reply) for reply in replies]

    def waiting_request(self, waiting: Waiting) -> QueuedRequest | None:
        """A waiting request's prompt and parameters, before claiming it (admission by memory
        weighs its prompt and max_tokens); None if its hash is gone (it expired, say)."""
        prompt, params = self.client.hmget(self.keys.req(waiting.id), "prompt", "params")
        if prompt is None or params is None:
            return None
        return QueuedRequest.from_hash({"id": waiting.id, "priority": str(waiting.priority),
                                        "prompt": text(prompt), "params": text(params)})

    def resumed(self, request_id: str, n: int = 1) -> list[Resumed]:
        """Each of the request's n answers as the stream holds it (index: its choice)."""
        ids: list[list[int]] = [[] for _ in range(n)]
        pieces: list[list[str]] = [[] for _ in range(n)]
        ended = [False] * n
        for _entry, event in events(self.client.xrange(self.keys.out(request_id))):
            if isinstance(event, Token) and event.prompt_logprobs is None and event.choice < n:  # not the echo
                ids[event.choice].extend(event.token_ids)
                pieces[event.choice].append(event.text)
            elif isinstance(event, Done) and event.choice < n:
                ended[event.choice] = True
        return [Resumed(i, "".join(p), e) for i, p, e in zip(ids, pieces, ended)]

    def report(self, held: Sequence[Held], now_ms: int) -> Verdict:
        """One round trip per step (report.lua), fenced per request."""
        return self.report_and_finish(held, [], now_ms)[0]

    def report_and_finish(self, held: Sequence[Held], ends: Sequence[Ending], now_ms: int,
                          ) -> tuple[Verdict, list[bool]]:
        """A step's report, then the requests that ended in it, in one round trip: the verdict,
        and for each ending whether it ended (False: this worker no longer held that claim, so
        nothing was written; see finish)."""
        calls = []
        if held:
            entries = [scripts.Reported(h.id, h.claim_seq, h.generated, h.slot, h.first_token, h.gave_way_to,
                                        h.priority, [event_fields(e) for e in h.tokens], h.cached_tokens)
                       for h in held]
            calls.append(scripts.report(self.keys, self.worker_id, now_ms, now_ms + self.lease_ms, entries))
        calls += [self._finish_call(end, now_ms) for end in ends]
        if not calls:
            return Verdict(frozenset(), frozenset()), []
        replies = scripts.run_all(self.client, self._scripts, calls)
        verdict = Verdict(frozenset(), frozenset())
        if held:
            results = [ReportResult(int(r)) for r in replies.pop(0)]
            verdict = Verdict(frozenset(h.id for h, r in zip(held, results) if r is ReportResult.LOST),
                              frozenset(h.id for h, r in zip(held, results) if r is ReportResult.CANCEL_ASKED))
        return verdict, [FinishResult(int(r)) is FinishResult.ENDED for r in replies]

    def finish(self, request_id: str, claim_seq: int, event: Event | None, status: RequestStatus,
               completion_tokens: int, now_ms: int) -> bool:
        """End a request: `event` is its last stream entry (None for a cancel: finish.lua writes
        the cancel event). False when this worker no longer holds that claim: nothing was
        written. Counted in the model's metrics hash in the same script (queues/metrics.py)."""
        return self.report_and_finish([], [Ending(request_id, claim_seq, event, status, completion_tokens)],
                                      now_ms)[1][0]

    def _finish_call(self, end: Ending, now_ms: int) -> scripts.Call:
        event = end.event
        if event is None:
            reason = RequestStatus.CANCELLED.value
        else:
            reason = event.finish_reason if isinstance(event, Done) else event.code
        return scripts.finish(self.keys, end.id, self.worker_id, end.claim_seq, end.status.value, now_ms,
                              self.retention_s, end.completion_tokens, reason, metrics.bounds_arg(),
                              None if event is None else event_fields(event))

    def _requeue(self, request_id: str, now_ms: int, owner: str | None = None, claim_seq: int | None = None,
                 lost: bool = True) -> RequeueResult:
        return RequeueResult(int(scripts.run(self._scripts, scripts.requeue(
            self.keys, request_id, now_ms, self.max_attempts, self.retention_s, owner, claim_seq, lost))))

    def expire_overdue(self, now_ms: int, limit: int = 256) -> list[str]:
        """The deadline sweep: waiting requests whose queue_timeout passed leave the queue with a
        queue_timeout error. Any worker runs it (so does the API for its own client's request):
        expiry needs no particular process alive."""
        due = [text(rid) for rid in self.client.zrangebyscore(self.keys.deadlines, "-inf", now_ms, start=0, num=limit)]
        return [rid for rid in due if ExpireResult(int(scripts.run(
            self._scripts, scripts.expire(self.keys, rid, now_ms, self.retention_s)))) is ExpireResult.EXPIRED]

    def requeue_expired(self, now_ms: int) -> list[str]:
        """Give back claims whose lease ran out (their worker died or froze): original place in the
        queue, or failed as worker_lost once a request has lost `max_attempts` claims."""
        return [text(rid) for rid in self.client.zrangebyscore(self.keys.running, "-inf", now_ms)
                if self._requeue(text(rid), now_ms) is not RequeueResult.NOTHING]

    def give_back(self, held: Iterable[tuple[str, int]], now_ms: int, lost: bool = False) -> list[str]:
        """This worker hands back its claims (request id, claim_seq) at once, in their original
        places; what they already streamed is kept, and the next worker resumes after it. A clean
        stop is not counted as lost; a step that broke is (`lost`). A claim it no longer holds is
        left alone."""
        return [rid for rid, seq in held
                if self._requeue(rid, now_ms, self.worker_id, seq, lost) is RequeueResult.REQUEUED]

    def reclaim_from_dead(self, is_dead: Callable[[str], bool], now_ms: int) -> list[str]:
        """Claims held by workers known to be dead (same host, no such process) go back now
        rather than when their leases run out. Counted as lost. (The dead workers leave the
        fleet through queues/membership.py `forget_dead`.)"""
        running = [text(r) for r in self.client.zrange(self.keys.running, 0, -1)]
        if not running:
            return []
        pipe = self.client.pipeline(transaction=False)
        for rid in running:
            pipe.hget(self.keys.req(rid), "worker")
        owners = [text(w) if w else "" for w in pipe.execute()]
        dead = {w for w in set(owners) if w and w != self.worker_id and is_dead(w)}
        return [rid for rid, w in zip(running, owners)
                if w in dead and self._requeue(rid, now_ms, w) is not RequeueResult.NOTHING]

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until an enqueue pushes a wake-up, or another worker leaves this one a request
        whose prefix it holds (queues/membership.py `wake`), or the timeout passes."""
        self.client.blpop([self.keys.wake, self.keys.wake_worker(self.worker_id)], timeout=timeout_s)

