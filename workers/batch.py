"""The RQ job that runs one batch, and `strata batch-worker` (an RQ worker that runs them).

A batch's job feeds its prepared lines into the model's queue at the batch's priority, with at
most `batch_inflight` outstanding, reads each line's output stream, records each line's result
once (queues/lua/batch_result.lua), and at the end writes the output and error files.

Exactly once across a crash: each line's request id is `<batch id>-<line>`; enqueue answers
DUPLICATE for one already queued, and the job re-attaches to its output stream (from its start)
instead of queueing it again. A result is recorded only if the line had none. The job holds a
lease on its batch (renewed as it runs); when its worker dies the lease runs out and
`strata batch-worker` (any of them, on a timer) enqueues a new job that carries on."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import redis
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from api import batch_lines
from queues.batches import (
    FINAL,
    RQ_QUEUE,
    BatchStore,
    LineQueue,
    job_waiting,
    request_id,
    submit_job,
)
from queues.files import FileStore
from queues.records import Done, Failed, QueuedRequest, Token
from queues.scripts import QueueRefused
from queues.server import REDIS_URL_ALIASES

log = logging.getLogger("strata.batch")


class BatchWorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STRATA_", extra="ignore")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=REDIS_URL_ALIASES,
        description="Redis holding the queues, the batches and the RQ queue",
    )
    batch_inflight: int = Field(16, ge=1, description="most lines of one batch queued or running at once")
    batch_lease_ms: int = Field(
        30_000, ge=200, description="a batch whose job stopped renewing for this long is taken over by a new job"
    )
    batch_sweep_s: float = Field(5.0, gt=0, description="how often the worker looks for batches left without a job")
    batch_read_block_ms: int = Field(250, ge=10, description="longest block reading the lines' output streams")
    max_waiting: int = Field(1000, ge=0, description="as the API's: a line shed by the queue is retried later")
    queue_hard_limit: int = Field(10000, ge=0, description="as the API's")
    retention_s: int = Field(3600, ge=0, description="how long a cancelled line's request record stays")


class LeaseLost(Exception):
    """Another job took the batch over (this one was too slow to renew): stop without writing."""


@dataclass
class Flight:
    line: int
    custom_id: str
    rid: str
    after: str = "0-0"
    parts: list[str] = field(default_factory=list)


class BatchRun:
    def __init__(self, client: redis.Redis, batch_id: str, settings: BatchWorkerSettings,
                 clock_s: Callable[[], float] = time.time) -> None:
        self.client = client
        self.batch_id = batch_id
        self.settings = settings
        self.clock_s = clock_s
        self.store = BatchStore(client)
        self.files = FileStore(client)
        self.token = uuid.uuid4().hex
        self._renewed = 0.0

    def run(self) -> str:
        """Run the batch to its end; returns its final status ('busy' when another job runs it)."""
        if not self.store.take_lease(self.batch_id, self.token, self.settings.batch_lease_ms):
            log.info("batch %s is run by another job", self.batch_id)
            return "busy"
        self._renewed = time.monotonic()
        try:
            batch = self.store.get(self.batch_id)
            if batch is None:
                return "missing"
            if batch["status"] in FINAL:
                return batch["status"]
            self.store.advance(self.batch_id, ("validating",), "in_progress", "in_progress_at", self._now())
            return self._run(batch)
        except LeaseLost:
            log.warning("batch %s: lease lost; another job carries on", self.batch_id)
            return "lease_lost"
        finally:
            self.store.release_lease(self.batch_id, self.token)

    # -- feeding and collecting ---------------------------------------------------------------
    def _run(self, batch: dict[str, str]) -> str:
        s = self.settings
        self.endpoint, self.model = batch["endpoint"], batch["model"]
        self.fields = {"key_name": batch["key_name"]} if batch.get("key_name") else None  # who asked, for operators
        priority, expires_at = int(batch["priority"]), int(batch["expires_at"])
        queue = LineQueue(self.client, self.model, max_waiting=s.max_waiting, hard_limit=s.queue_hard_limit,
                          retention_s=s.retention_s)
        recorded = self.store.recorded(self.batch_id)
        todo = deque(n for n in range(int(batch["total"])) if n not in recorded)
        inflight: dict[str, Flight] = {}
        stopping: str | None = None  # "cancelled" or "expired"
        log.info("batch %s: %d lines to go at priority %d", self.batch_id, len(todo), priority)
        while True:
            self._renew()
            if stopping is None:
                if self.store.status(self.batch_id) == "cancelling":
                    stopping = "cancelled"
                elif self._now() >= expires_at:
                    stopping = "expired"
                if stopping:
                    for flight in inflight.values():
                        queue.cancel(flight.rid)
            if stopping is None:
                self._feed(queue, todo, inflight, priority)
            if not inflight:
                if stopping or not todo:
                    break
                time.sleep(s.batch_read_block_ms / 1000)  # the queue shed the next line: retry
                continue
            events = queue.read({rid: f.after for rid, f in inflight.items()}, s.batch_read_block_ms)
            for rid, entries in events.items():
                if self._take(inflight[rid], entries, stopping):
                    del inflight[rid]
            if stopping:
                self._drop_cancelled(queue, inflight, stopping)
        return self._finish(stopping)

    def _feed(self, queue: LineQueue, todo: deque[int], inflight: dict[str, Flight], priority: int) -> None:
        room = self.settings.batch_inflight - len(inflight)
        numbers = list(todo)[: max(room, 0)]
        for number, raw in zip(numbers, self.store.lines(self.batch_id, numbers)):
            line = json.loads(raw)
            if "error" in line:  # refused at creation with what the endpoint would answer
                entry = batch_lines.response_entry(self.batch_id, number, line["custom_id"], line["status_code"],
                                                   {"error": line["error"]})
                self.store.record(self.batch_id, number, entry, "failed")
                todo.popleft()
                continue
            rid = request_id(self.batch_id, number)
            try:
                queue.enqueue(QueuedRequest(id=rid, priority=priority, **line["request"]), self.fields)
            except QueueRefused:
                return  # shed (the queue is full at this priority): the line waits for a later turn
            todo.popleft()
            inflight[rid] = Flight(number, line["custom_id"], rid)

    def _take(self, flight: Flight, entries: list, stopping: str | None) -> bool:
        """Read a line's events; True when it ended (its result is recorded)."""
        for entry_id, event in entries:
            flight.after = entry_id
            if isinstance(event, Token):
                flight.parts.append(event.text)
            elif isinstance(event, Done):
                body = batch_lines.answer_body(
                    self.endpoint, flight.rid, self.model, int(self._now()), "".join(flight.parts),
                    event.finish_reason, event.prompt_tokens, event.completion_tokens,
                )
                entry = batch_lines.response_entry(self.batch_id, flight.line, flight.custom_id, 200, body)
                self.store.record(self.batch_id, flight.line, entry, "completed")
                return True
            elif isinstance(event, Failed):
                if event.code == "cancelled" and stopping:
                    self._record_unrun(flight.line, flight.custom_id, stopping)
                else:
                    status, body = batch_lines.failure_body(event)
                    entry = batch_lines.response_entry(self.batch_id, flight.line, flight.custom_id, status, body)
                    self.store.record(self.batch_id, flight.line, entry, "failed")
                return True
        return False

    def _drop_cancelled(self, queue: LineQueue, inflight: dict[str, Flight], stopping: str) -> None:
        """A running request that was cancelled ends without an event: its status says so."""
        statuses = queue.statuses(list(inflight))
        for rid, status in statuses.items():
            if status in (None, "cancelled"):
                flight = inflight.pop(rid)
                self._record_unrun(flight.line, flight.custom_id, stopping)

    def _record_unrun(self, line: int, custom_id: str, stopping: str) -> None:
        why = "The batch was cancelled" if stopping == "cancelled" else "The batch expired"
        entry = batch_lines.unrun_entry(self.batch_id, line, custom_id, f"batch_{stopping}",
                                        f"{why} before this request completed.")
        self.store.record(self.batch_id, line, entry, "")

    # -- the end ------------------------------------------------------------------------------
    def _finish(self, stopping: str | None) -> str:
        batch_id = self.batch_id
        if stopping is None:
            after = self.store.advance(batch_id, ("in_progress",), "finalizing", "finalizing_at", self._now())
            if after == "cancelling":
                stopping = "cancelled"  # every line ended before the cancel mattered
        if stopping:
            total = int(self.store.get(batch_id)["total"])
            missing = [n for n in range(total) if n not in self.store.recorded(batch_id)]
            for number, raw in zip(missing, self.store.lines(batch_id, missing)):
                self._record_unrun(number, json.loads(raw)["custom_id"], stopping)
        self._renew()
        self._write_files()
        if stopping == "cancelled":
            return self.store.advance(batch_id, ("cancelling",), "cancelled", "cancelled_at", self._now())
        if stopping == "expired":
            return self.store.advance(batch_id, ("in_progress", "cancelling"), "expired", "expired_at", self._now())
        return self.store.advance(batch_id, ("finalizing",), "completed", "completed_at", self._now())

    def _write_files(self) -> None:
        """Output: the lines answered 200; errors: the others. Rebuilt whole (same ids) when a
        restarted job finalizes again."""
        output, errors = [], []
        for _line, result in self.store.results(self.batch_id):
            entry = json.loads(result)
            ok = entry["response"] is not None and entry["response"]["status_code"] == 200
            (output if ok else errors).append(result + "\n")
        short = self.batch_id.removeprefix("batch_")
        fields: dict[str, str] = {}
        now = int(self._now())
        fields["output_file_id"] = self.files.put(
            "".join(output).encode(), filename=f"{self.batch_id}_output.jsonl", purpose="batch_output",
            now_s=now, file_id=f"file-{short}-output",
        ).id
        if errors:
            fields["error_file_id"] = self.files.put(
                "".join(errors).encode(), filename=f"{self.batch_id}_error.jsonl", purpose="batch_output",
                now_s=now, file_id=f"file-{short}-error",
            ).id
        self.store.update(self.batch_id, fields)

    def _renew(self) -> None:
        if time.monotonic() - self._renewed < self.settings.batch_lease_ms / 3000:
            return
        if not self.store.take_lease(self.batch_id, self.token, self.settings.batch_lease_ms):
            raise LeaseLost(self.batch_id)
        self._renewed = time.monotonic()

    def _now(self) -> int:
        return int(self.clock_s())


def run_batch(batch_id: str) -> str:
    """The RQ job (queues.batches.JOB_FUNCTION). Settings come from STRATA_ variables."""
    settings = BatchWorkerSettings()
    client = redis.Redis.from_url(settings.redis_url, health_check_interval=30, retry_on_timeout=True)
    try:
        status = BatchRun(client, batch_id, settings).run()
        log.info("batch %s: %s", batch_id, status)
        return status
    finally:
        client.close()


# ---- strata batch-worker ---------------------------------------------------------------------


def sweep(client: redis.Redis) -> list[str]:
    """Enqueue a job for every unfinished batch that nobody runs (no lease) and whose job is not
    waiting in the RQ queue: its worker died, or the API stopped between storing it and queueing
    its job. Returns the batch ids taken up."""
    store = BatchStore(client)
    taken = []
    for batch_id in store.active():
        batch = store.get(batch_id)
        if batch is None or batch["status"] in FINAL or store.is_leased(batch_id):
            continue
        if job_waiting(client, batch.get("rq_job_id")):
            continue
        store.update(batch_id, {"rq_job_id": submit_job(client, batch_id)})
        taken.append(batch_id)
    return taken


def run_batch_worker(settings: BatchWorkerSettings) -> None:
    """An RQ worker on the batches' queue, plus a timer that re-enqueues orphaned batches."""
    from rq import Queue, Worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    client = redis.Redis.from_url(settings.redis_url, health_check_interval=30, retry_on_timeout=True)
    for attempt in range(100):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if attempt == 99:
                raise
            time.sleep(0.2)

    def sweeping() -> None:
        sweeper = redis.Redis.from_url(settings.redis_url, health_check_interval=30, retry_on_timeout=True)
        while True:
            try:
                for batch_id in sweep(sweeper):
                    log.info("batch %s had no live job: enqueued a new one", batch_id)
            except redis.exceptions.RedisError:
                log.warning("sweep failed", exc_info=True)
            time.sleep(settings.batch_sweep_s)

    threading.Thread(target=sweeping, name="batch-sweep", daemon=True).start()
    worker = Worker([Queue(RQ_QUEUE, connection=client)], connection=client)
    worker.work(logging_level="INFO")
