"""The Redis side of /metrics: what workers accumulate, and what a scrape reads.

Counters and histograms live in one hash per model, `strata:{m}:metrics`, written atomically
by finish.lua and requeue.lua (one request ends: counted once, even if its lease ran out
meanwhile) and by report.lua (a read gave way). Its fields, by the request's exact priority p (already clamped by the
API, so bounded by the clamp range; the API folds them into bounded labels):

    requests:<p>:<status>          requests that ended on a worker (finished|failed|cancelled)
    prompt_tokens:<p>              prompt tokens of finished requests (tokens in)
    completion_tokens:<p>          completion tokens of finished requests (tokens out)
    give_ways:<p>                  times a read of priority p gave way at a chunk boundary
    <hist>:<p>:le=<ms>             finished requests whose <hist> fell in this bucket (not cumulative)
    <hist>:<p>:sum                 the sum of the observations, in ms

with <hist> one of queue_ms (claimed − enqueued), first_token_ms (first token − enqueued) and
latency_ms (finished − enqueued). Gauges are not stored: a scrape reads them live from the keys
the queue already keeps (waiting, running, worker hashes). What /health and /v1/models read
is queues/membership.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from queues.keys import Keys, Member, models_key
from queues.records import decoded, text
from queues.worker_state import WorkerState

# Histogram upper bounds (ms) shared by the three histograms: 10 ms … 10 min.
BUCKETS_MS: tuple[int, ...] = (
    10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 120_000, 300_000, 600_000,
)
HISTOGRAMS = ("queue_ms", "first_token_ms", "latency_ms")
INF = "+Inf"


def bounds_arg() -> str:
    """finish.lua's `bounds`."""
    return ",".join(map(str, BUCKETS_MS))


@dataclass
class Histogram:
    """One histogram at one priority: bucket counts (not cumulative) by upper bound in ms
    (math.inf for +Inf), and the sum in ms."""

    buckets: dict[float, int] = field(default_factory=dict)
    sum_ms: int = 0

    @property
    def count(self) -> int:
        return sum(self.buckets.values())


@dataclass
class Recorded:
    """The metrics hash of one model, parsed. Keys are exact priorities."""

    requests: dict[tuple[int, str], int] = field(default_factory=dict)  # (priority, status)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)
    give_ways: dict[int, int] = field(default_factory=dict)
    histograms: dict[str, dict[int, Histogram]] = field(default_factory=lambda: {h: {} for h in HISTOGRAMS})


def parse(fields: dict[str, str]) -> Recorded:
    recorded = Recorded()
    simple = {"prompt_tokens": recorded.prompt_tokens, "completion_tokens": recorded.completion_tokens,
              "give_ways": recorded.give_ways}
    for name, value in fields.items():
        parts = name.split(":")
        try:
            priority, count = int(parts[1]), int(value)
        except (IndexError, ValueError):
            continue  # not ours: ignore rather than fail a scrape
        if parts[0] == "requests" and len(parts) == 3:
            recorded.requests[(priority, parts[2])] = count
        elif parts[0] in simple and len(parts) == 2:
            simple[parts[0]][priority] = count
        elif parts[0] in recorded.histograms and len(parts) == 3:
            hist = recorded.histograms[parts[0]].setdefault(priority, Histogram())
            if parts[2] == "sum":
                hist.sum_ms = count
            elif parts[2].startswith("le="):
                bound = parts[2][3:]
                hist.buckets[math.inf if bound == INF else float(bound)] = count
    return recorded


@dataclass
class ModelView:
    """Everything a scrape says about one model."""

    model: str
    waiting: list[int]  # one count per asked priority range, in the order asked
    running: list[int]  # priorities of the claimed requests
    workers: list[tuple[str, WorkerState]]  # (worker id, what it published)
    last_heartbeat_ms: int | None  # newest worker heartbeat ever (strata:models), None: never
    recorded: Recorded


async def view(
    client: aioredis.Redis,
    model: str,
    ranges: list[tuple[float, float]],
    now_ms: int,
    live_within_ms: int,
) -> ModelView:
    """Read one model's state. `ranges` are inclusive priority intervals (±math.inf allowed);
    workers are those with a heartbeat in the last `live_within_ms` whose hash still exists."""
    k = Keys(model)
    aged = await client.hexists(k.policy, "aging_s")
    pipe = client.pipeline(transaction=False)
    if aged:  # the score mixes priority and arrival: read each waiting request's priority
        pipe.zrange(k.waiting, 0, -1)
    else:
        for lo, hi in ranges:  # score = -priority
            pipe.zcount(k.waiting, _score(-hi), _score(-lo))
    pipe.zrange(k.running, 0, -1)
    pipe.zrangebyscore(k.workers, now_ms - live_within_ms, "+inf")
    pipe.zscore(models_key(), model)
    pipe.hgetall(k.metrics)
    *waiting, running_ids, worker_ids, last_beat, metrics = await pipe.execute()
    if aged:
        waiting = await _waiting_by_range(client, k, [text(m) for m in waiting[0]], ranges)

    pipe = client.pipeline(transaction=False)
    for rid in running_ids:
        pipe.hget(k.req(text(rid)), "priority")
    for wid in worker_ids:
        pipe.hgetall(k.worker(text(wid)))
    replies = await pipe.execute()
    running = [int(p) for p in replies[: len(running_ids)] if p is not None]
    workers = [
        (text(wid), WorkerState.from_hash(decoded(h)))
        for wid, h in zip(worker_ids, replies[len(running_ids):])
        if h
    ]
    return ModelView(
        model=model,
        waiting=[int(n) for n in waiting],
        running=running,
        workers=workers,
        last_heartbeat_ms=None if last_beat is None else int(last_beat),
        recorded=parse(decoded(metrics)),
    )


async def _waiting_by_range(client: aioredis.Redis, k: Keys, members: list[str],
                            ranges: list[tuple[float, float]]) -> list[int]:
    pipe = client.pipeline(transaction=False)
    for member in members:
        pipe.hget(k.req(Member.parse(member).id), "priority")
    counts = [0] * len(ranges)
    for priority in await pipe.execute():
        p = int(priority or 0)
        for i, (lo, hi) in enumerate(ranges):
            if lo <= p <= hi:
                counts[i] += 1
                break
    return counts


def _score(value: float) -> str | float:
    return "-inf" if value == -math.inf else "+inf" if value == math.inf else value
