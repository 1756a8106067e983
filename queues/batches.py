"""Batches (OpenAI Batch API) in Redis: the batch object and its state changes, the lines
prepared at creation, each line's result (recorded once), and the lease of the RQ job running
it. The job feeds the lines into the model's queue through queues/intake.py, as the API does;
the RQ job that runs a batch is batches/handoff.py's.

A batch's status (OpenAI's words, `BatchStatus`):
validating -> in_progress -> finalizing -> completed
validating | in_progress -> cancelling -> cancelled;   in_progress | cancelling -> expired (24 h window)."""

from __future__ import annotations

import enum
import json
import time

import redis
import redis.exceptions

from queues import scripts
from queues.keys import batch_key, batch_lease_key, batch_lines_key, batch_results_key, batches_active_key, batches_key
from queues.records import decoded, text
from queues.scripts import LeaseResult, LineResult


class BatchStatus(enum.StrEnum):
    """Where a batch is in its life; the values are what the batch hash and the API say."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"  # OpenAI's status for a file that did not validate; here that is a 400 instead
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        """Nothing happens to the batch any more: no job runs it, the sweep leaves it alone."""
        return self in _FINAL


_FINAL = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})

# Every move a batch makes (the docstring's arrows); BatchStore.advance makes no other.
TRANSITIONS: frozenset[tuple[BatchStatus, BatchStatus]] = frozenset({
    (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
    (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING),
    (BatchStatus.FINALIZING, BatchStatus.COMPLETED),
    (BatchStatus.VALIDATING, BatchStatus.CANCELLING),
    (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING),
    (BatchStatus.CANCELLING, BatchStatus.CANCELLED),
    (BatchStatus.IN_PROGRESS, BatchStatus.EXPIRED),
    (BatchStatus.CANCELLING, BatchStatus.EXPIRED),
})


class BatchNotFound(Exception):
    pass


def request_id(batch_id: str, line: int) -> str:
    """Deterministic: a restarted job finds the line's request again (enqueue says DUPLICATE)."""
    return f"{batch_id}-{line}"


class BatchStore:
    """The batch object and its lines. `client` is a sync Redis client (any decode_responses)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._scripts = scripts.register(client, scripts.BATCH_SCRIPTS)

    # -- the batch object ---------------------------------------------------------------------
    def create(self, batch: dict[str, str | int], lines: list[str]) -> None:
        """Store a new batch with its prepared lines (line number = index, from 0)."""
        batch_id = str(batch["id"])
        pipe = self.client.pipeline(transaction=False)
        key = batch_lines_key(batch_id)
        for start in range(0, len(lines), 1000):
            pipe.hset(key, mapping={str(n): lines[n] for n in range(start, min(start + 1000, len(lines)))})
        pipe.hset(batch_key(batch_id), mapping=batch)
        pipe.zadd(batches_key(), {batch_id: int(batch["created_at"])})
        pipe.sadd(batches_active_key(), batch_id)
        pipe.execute()

    def get(self, batch_id: str) -> dict[str, str] | None:
        return decoded(self.client.hgetall(batch_key(batch_id))) or None

    def update(self, batch_id: str, fields: dict[str, str | int]) -> None:
        self.client.hset(batch_key(batch_id), mapping=fields)

    def status(self, batch_id: str) -> BatchStatus | None:
        value = self.client.hget(batch_key(batch_id), "status")
        return None if value is None else BatchStatus(text(value))

    def advance(self, batch_id: str, from_statuses: tuple[BatchStatus, ...], to: BatchStatus, stamp: str = "",
                now_s: int | None = None) -> BatchStatus:
        """Move to `to` when the batch is in one of `from_statuses`; returns the status after."""
        unlisted = [f"{was}->{to}" for was in from_statuses if (was, to) not in TRANSITIONS]
        if unlisted:
            raise ValueError(f"not a move a batch makes: {', '.join(unlisted)}")
        now_s = int(time.time()) if now_s is None else now_s
        try:
            status = BatchStatus(text(scripts.run(self._scripts, scripts.batch_advance(
                batch_id, from_statuses, to, stamp, now_s))))
        except redis.exceptions.ResponseError as error:
            if str(error).startswith("NOT_FOUND"):
                raise BatchNotFound(batch_id) from None
            raise
        if status.is_final:
            self.forget(batch_id)
        return status

    def list(self, limit: int = 20, after: str | None = None) -> tuple[list[dict[str, str]], bool]:
        """Newest first, starting after the batch id `after`; and whether more remain."""
        start = 0
        if after:
            rank = self.client.zrevrank(batches_key(), after)
            start = 0 if rank is None else rank + 1
        ids = [text(i) for i in self.client.zrevrange(batches_key(), start, start + limit)]
        found = [b for b in (self.get(i) for i in ids[:limit]) if b]
        return found, len(ids) > limit

    def active(self) -> list[str]:
        return sorted(text(i) for i in self.client.smembers(batches_active_key()))

    def forget(self, batch_id: str) -> None:
        """An ended batch leaves the set of active ones (what the sweep looks at)."""
        self.client.srem(batches_active_key(), batch_id)

    # -- lines and results ---------------------------------------------------------------------
    def lines(self, batch_id: str, numbers: list[int]) -> list[str]:
        if not numbers:
            return []
        return [text(v) for v in self.client.hmget(batch_lines_key(batch_id), [str(n) for n in numbers])]

    def recorded(self, batch_id: str) -> set[int]:
        """Line numbers that already have a result."""
        return {int(text(n)) for n in self.client.hkeys(batch_results_key(batch_id))}

    def record(self, batch_id: str, line: int, result: dict, count: str) -> bool:
        """A line's result, once: False when it already had one. `count`: 'completed', 'failed' or ''."""
        done = scripts.run(self._scripts, scripts.batch_result(
            batch_id, line, json.dumps(result, separators=(",", ":")), count))
        return LineResult(int(done)) is LineResult.RECORDED

    def results(self, batch_id: str) -> list[tuple[int, str]]:
        """Every recorded result, in line order."""
        raw = self.client.hgetall(batch_results_key(batch_id))
        return sorted((int(text(n)), text(v)) for n, v in raw.items())

    # -- the lease of the job running it -------------------------------------------------------
    def take_lease(self, batch_id: str, token: str, lease_ms: int) -> bool:
        """Take or renew; False when another job holds it."""
        held = scripts.run(self._scripts, scripts.batch_lease(batch_id, token, lease_ms))
        return LeaseResult(int(held)) is LeaseResult.HELD

    def release_lease(self, batch_id: str, token: str) -> None:
        scripts.run(self._scripts, scripts.batch_lease(batch_id, token, 0))

    def is_leased(self, batch_id: str) -> bool:
        return bool(self.client.exists(batch_lease_key(batch_id)))
