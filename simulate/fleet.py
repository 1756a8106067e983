"""N real workers (workers/loop.py Worker, workers/scheduler.py) over fake engines that cost what
the profile says, one Redis running the production Lua scripts, one virtual clock: a discrete
event simulation with no sleeps and no wall clock.

Each worker has its own virtual clock: the time at which its current step ends. The worker
whose clock is earliest steps next, after every arrival due by then is enqueued (enqueue.lua,
at its own arrival time). A worker with nothing to do sleeps until the next arrival or its
next --idle-wait-s poll, as the real one blocks on the wake list (an enqueue wakes it at once).
A step runs whole at its start time (the real loop's claims are also read then); its reports are
stamped with the time its engine calls end. With several workers that is the one approximation:
a step's effects become visible to the others at its start rather than its end.

The simulation makes no scheduling decision of its own: it drives Worker.step(), and the
Claims (WatchedClaims), Membership (WatchedMembership) and Replay calls of queues/ carry every
Redis write."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import redis

from engine.cost_profile import CostProfile
from engine.fake import FakeEngine
from queues.claims import Claimed, Claims, Ending, Held, Verdict, Waiting
from queues.membership import Membership
from queues.records import QueuedRequest
from queues.replay import Replay
from queues.worker_state import WorkerState
from simulate.workload import Arrival
from workers.loop import Worker
from workers.settings import WorkerSettings

MODEL = "simulated"
HARVEST_MS = 5_000  # how often (virtual) ended requests are collected from Redis and deleted
LONG_LEASE_MS = 10 * 24 * 3600 * 1000  # without exact reports nothing renews a lease: none may run out


class CountingDecoder:
    """Text is not simulated: one character per token, so a stream's length is its token count
    and detokenizing costs nothing measurable."""

    def decode(self, ids: Sequence[int]) -> str:
        return "x" * len(ids)


class WatchedClaims(Claims):
    """Claims that note which requests may have ended (finished, or expired at a claim or a
    sweep), so only those are read back from Redis.

    Unless `exact`, only what a scheduling decision depends on goes to Redis, which is most of
    the simulation's speed: a step's report only for the requests it says something the
    schedule depends on (claimed into a slot, first token, gave way), so a decode step that only
    streams tokens costs no round trip; no head read while the queue is known to be empty
    (QueueState); no worker hash (operators read it, no decision does). What that leaves out —
    token events, lease renewals, a cancel's answer — only matters for faults and clients, which
    a simulation has none of; leases are made long enough that none runs out, and nobody sweeps
    for them. `exact` (`--exact-reports`) does every call production does."""

    def __init__(self, *args, ended: set[str], exact: bool, queue: "QueueState", **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.ended = ended
        self.exact = exact
        self.queue = queue

    def claim_many(self, waiting: Sequence[Waiting], now_ms: int) -> list[Claimed | None]:
        claimed = super().claim_many(waiting, now_ms)
        self.ended.update(w.id for w, c in zip(waiting, claimed) if c is None)
        return claimed

    def report_and_finish(self, held: Sequence[Held], ends: Sequence[Ending], now_ms: int,
                          ) -> tuple[Verdict, list[bool]]:
        self.ended.update(end.id for end in ends)
        if not self.exact:
            held = [h for h in held if h.slot is not None or h.first_token or h.gave_way_to]
        return super().report_and_finish(held, ends, now_ms)

    def head(self, count: int = 1) -> list[Waiting]:
        if self.queue.known_empty and not self.exact:
            return []  # nothing was enqueued since Redis said the queue was empty
        found = super().head(count)
        self.queue.known_empty = not found
        return found

    def expire_overdue(self, now_ms: int, limit: int = 256) -> list[str]:
        if self.queue.known_empty and not self.exact:
            return []
        gone = super().expire_overdue(now_ms, limit)
        self.ended.update(gone)
        return gone

    def requeue_expired(self, now_ms: int) -> list[str]:
        return super().requeue_expired(now_ms) if self.exact else []  # leases are long: none runs out

    def reclaim_from_dead(self, is_dead: Callable[[str], bool], now_ms: int) -> list[str]:
        return []  # no worker process dies in a simulation


class WatchedMembership(Membership):
    """The fleet's keys as WatchedClaims treats the queue: unless `exact`, no worker hash
    (operators read it, no scheduling decision does) and no look for dead workers."""

    def __init__(self, *args, exact: bool, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.exact = exact

    def heartbeat(self, state: WorkerState, now_ms: int, ttl_s: int) -> None:
        if self.exact:
            super().heartbeat(state, now_ms, ttl_s)

    def forget_dead(self, is_dead: Callable[[str], bool]) -> list[str]:
        return []  # no worker process dies in a simulation


@dataclass
class QueueState:
    """What the simulation knows of the waiting queue without asking Redis: it is empty once a
    head read found nothing, until the next enqueue (claims and expiries only shorten it, and
    the simulation is one thread, so no one else enqueues)."""

    known_empty: bool = False


@dataclass
class Outcome:
    """What happened to every request: its arrival and the record its workers wrote."""

    records: dict[str, dict[str, str]] = field(default_factory=dict)  # id -> RECORD_FIELDS (ended ones)
    shed: list[Arrival] = field(default_factory=list)  # refused at enqueue (429)
    unfinished: list[Arrival] = field(default_factory=list)  # still waiting or running at the cut-off
    arrivals: list[Arrival] = field(default_factory=list)
    end_ms: int = 0  # virtual time when the last worker stopped
    steps: int = 0
    workers: int = 0
    slots: int = 0  # per worker


SHARED = 10**9  # a shared prefix's first id: beyond every request's own (index + 1)
MODEL_LEN = 8192  # --max-model-len's default here: the bundled profile's model's (SmolLM2's) own context
KV_BLOCK = 64  # the torch engine's block (engine/model.py), so prefix reuse ends where it would


def prompt_of(index: int, length: int, shared: int = 0, group: int = 0) -> list[int]:
    """A prompt that shares no prefix with any other (the first id after its class's shared
    header is its own), so no cached block is reused by accident, and the JSON stays short; the
    first `shared` tokens are the same for every request of `group` (a system prompt, a few-shot
    header), which the worker's KV pool then serves from its cached blocks, as in production."""
    head = ([SHARED + group] + [8] * (shared - 1))[:max(0, min(shared, length - 1))]
    rest = length - len(head)
    return head + [index + 1] + [7] * (rest - 1)


def run(arrivals: Sequence[Arrival], client: redis.Redis, settings: WorkerSettings, profile: CostProfile, *,
        workers: int = 1, max_waiting: int = 0, hard_limit: int = 0, ignore_priority: bool = False,
        drain_s: float = 3600.0, exact_reports: bool = False) -> Outcome:
    """Serve `arrivals` with `workers` workers configured by `settings`; `client` is an empty
    Redis. With `ignore_priority` every request is sent at 0 (what the service does without
    priorities; the outcome still reports them by their class's priority)."""
    quiet = logging.getLogger("strata.worker")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the real worker logs a line per admission
    try:
        return _serve(arrivals, client, settings, profile, workers, max_waiting, hard_limit, ignore_priority,
                      drain_s, exact_reports)
    finally:
        quiet.setLevel(level)


def _serve(arrivals: Sequence[Arrival], client: redis.Redis, settings: WorkerSettings, profile: CostProfile,
           workers: int, max_waiting: int, hard_limit: int, ignore_priority: bool, drain_s: float,
           exact_reports: bool) -> Outcome:
    ended: set[str] = set()
    queue = QueueState()
    fleet = []
    for n in range(workers):
        # the worker's paged KV pool, as `strata worker` builds it: --kv-tokens in 64-token blocks,
        # admission by memory, prefix blocks shared (workers/kv_pool.py does the bookkeeping)
        engine = FakeEngine(num_slots=settings.parallel, ctx=settings.max_model_len or MODEL_LEN, profile=profile,
                            kv_tokens=settings.pool_tokens(), kv_block=KV_BLOCK)
        claims = WatchedClaims(client, MODEL, f"sim-{n}", retention_s=settings.retention_s,
                               lease_ms=settings.lease_ms if exact_reports else LONG_LEASE_MS,
                               max_attempts=settings.max_attempts, ended=ended, exact=exact_reports, queue=queue)
        worker = Worker(engine, claims, CountingDecoder(), prefill_chunk=settings.prefill_chunk, policy=settings.policy(),
                        device=f"sim:{n}", heartbeat_ms=int(settings.heartbeat_s * 1000),
                        idle_wait_s=settings.idle_wait_s, clock=engine.clock,
                        membership=WatchedMembership(client, MODEL, f"sim-{n}", exact=exact_reports))
        worker.announce(0)
        fleet.append(worker)
    replay = Replay(client, MODEL, max_waiting=max_waiting, hard_limit=hard_limit)
    outcome = Outcome(arrivals=list(arrivals), workers=workers, slots=settings.parallel)
    priority_of = {a.id: a.priority for a in arrivals}
    pending: set[str] = set()
    nap_ms = int(settings.idle_wait_s * 1000)
    last_arrival = arrivals[-1].at_ms if arrivals else 0
    cut_off = last_arrival + int(drain_s * 1000)
    idle = [False] * workers
    next_harvest = HARVEST_MS
    i = 0
    while True:
        w = min(range(workers), key=lambda k: fleet[k].clock())
        now = fleet[w].clock()
        if now > cut_off:
            break
        while i < len(arrivals) and arrivals[i].at_ms <= now:
            a = arrivals[i]
            request = QueuedRequest(id=a.id, priority=0 if ignore_priority else a.priority,
                                    prompt=prompt_of(i, a.prompt_tokens, a.shared_prefix_tokens, a.group), max_tokens=a.max_tokens, ignore_eos=True,
                                    temperature=0)
            if replay.enqueue(request, a.at_ms, a.queue_timeout_ms):
                pending.add(a.id)
                queue.known_empty = False
            else:
                outcome.shed.append(a)
            i += 1
            idle = [False] * workers
        if now >= next_harvest:
            _harvest(replay, ended, pending, outcome)
            next_harvest = now + HARVEST_MS
        fleet[w].engine.start_step()  # the loop's own cost per step (profile.step_overhead_ms)
        busy = fleet[w].step()
        outcome.steps += 1
        if busy:
            idle[w] = False
            continue
        idle[w] = True
        nap = now + nap_ms
        if i < len(arrivals):
            nap = min(nap, arrivals[i].at_ms)
        fleet[w].clock.now_ms = max(now + 1, nap)
        if i == len(arrivals) and all(idle):
            _harvest(replay, ended, pending, outcome)
            if not pending:
                break
    _harvest(replay, ended, pending, outcome)
    ended.update(pending)
    _harvest(replay, ended, pending, outcome)
    outcome.unfinished = [a for a in arrivals if a.id in pending]
    outcome.end_ms = max(worker.clock() for worker in fleet)
    for record in outcome.records.values():
        record["priority"] = str(priority_of.get(record.get("id", ""), record["priority"]))
    return outcome


def _harvest(replay: Replay, ended: set[str], pending: set[str], outcome: Outcome) -> None:
    candidates = sorted(ended & pending)
    ended.clear()
    if not candidates:
        return
    found = replay.take_ended(candidates)
    for rid, record in found.items():
        record["id"] = rid
        outcome.records[rid] = record
        pending.discard(rid)
    ended.update(set(candidates) - set(found))  # not ended yet after all (another worker claimed it): look again
