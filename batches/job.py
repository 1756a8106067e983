"""The RQ job that runs one batch.

It feeds the batch's prepared lines into the model's queue at the batch's priority, with at most
`batch_inflight` outstanding, reads each line's output stream, records each line's result once
(queues/lua/batch_result.lua), and at the end writes the output and error files.

Exactly once across a crash: each line's request id is `<batch id>-<line>`; enqueue answers
DUPLICATE for one already queued, and the job re-attaches to its output stream (from its start)
instead of queueing it again. A result is recorded only if the line had none. The job holds a
lease on its batch (renewed as it runs); when its worker dies the lease runs out and
`strata batch-worker` (any of them, on a timer) enqueues a new job that carries on."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import redis

from batches import results
from batches.settings import BatchWorkerSettings
from queues.batches import BatchStatus, BatchStore, request_id
from queues.connect import connect, connect_async
from queues.files import FileStore
from queues.intake import Intake
from queues.lifecycle import RequestStatus
from queues.records import Done, Failed, QueuedRequest, Token
from shapes.choices import Choices
from queues.scripts import QueueError, QueueRefused

log = logging.getLogger("strata.batch")


class LeaseLost(Exception):
    """Another job took the batch over (this one was too slow to renew): stop without writing."""


@dataclass
class Flight:
    line: int
    custom_id: str
    rid: str
    after: str = "0-0"
    reading: dict[str, str] = field(default_factory=dict)  # how its answer splits (shapes.answers.Job)
    answers: Choices = field(default_factory=Choices)  # its n answers' events so far


class BatchRun:
    """One run of a batch's job. Its own records go through the sync `client`; the lines go
    through the API's Intake (asyncio), driven by an event loop this run keeps for its life."""

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
            if BatchStatus(batch["status"]).is_final:
                return batch["status"]
            self.store.advance(self.batch_id, (BatchStatus.VALIDATING,), BatchStatus.IN_PROGRESS, "in_progress_at",
                               self._now())
            with asyncio.Runner() as loop:
                return self._run(batch, loop)
        except LeaseLost:
            log.warning("batch %s: lease lost; another job carries on", self.batch_id)
            return "lease_lost"
        finally:
            self.store.release_lease(self.batch_id, self.token)

    # -- feeding and collecting ---------------------------------------------------------------
    def _run(self, batch: dict[str, str], loop: asyncio.Runner) -> str:
        s = self.settings
        self.endpoint, self.model = batch["endpoint"], batch["model"]
        self.fields = {"key_name": batch["key_name"]} if batch.get("key_name") else None  # who asked, for operators
        priority, expires_at = int(batch["priority"]), int(batch["expires_at"])
        client = connect_async(s.redis_url, cluster=s.redis_cluster)
        queue = Intake(client, self.model, max_waiting=s.max_waiting, hard_limit=s.queue_hard_limit,
                       retention_s=s.retention_s)
        try:
            recorded = self.store.recorded(self.batch_id)
            todo = deque(n for n in range(int(batch["total"])) if n not in recorded)
            inflight: dict[str, Flight] = {}
            stopping: BatchStatus | None = None  # CANCELLED or EXPIRED
            log.info("batch %s: %d lines to go at priority %d", self.batch_id, len(todo), priority)
            while True:
                self._renew()
                if stopping is None:
                    if self.store.status(self.batch_id) == BatchStatus.CANCELLING:
                        stopping = BatchStatus.CANCELLED
                    elif self._now() >= expires_at:
                        stopping = BatchStatus.EXPIRED
                    if stopping:
                        for flight in inflight.values():
                            loop.run(queue.cancel(flight.rid))
                if stopping is None:
                    self._feed(queue, loop, todo, inflight, priority)
                if not inflight:
                    if stopping or not todo:
                        break
                    time.sleep(s.batch_read_block_ms / 1000)  # the queue shed the next line: retry
                    continue
                events = loop.run(queue.read_many({rid: f.after for rid, f in inflight.items()},
                                                  s.batch_read_block_ms))
                for rid, entries in events.items():
                    if self._take(inflight[rid], entries, stopping):
                        del inflight[rid]
                if stopping:
                    self._drop_cancelled(loop.run(queue.statuses(list(inflight))), inflight, stopping)
        finally:
            loop.run(client.aclose())
        return self._finish(stopping)

    def _feed(self, queue: Intake, loop: asyncio.Runner, todo: deque[int], inflight: dict[str, Flight],
              priority: int) -> None:
        room = self.settings.batch_inflight - len(inflight)
        numbers = list(todo)[: max(room, 0)]
        for number, raw in zip(numbers, self.store.lines(self.batch_id, numbers)):
            line = json.loads(raw)
            if "error" in line:  # refused at creation with what the endpoint would answer
                entry = results.response_entry(self.batch_id, number, line["custom_id"], line["status_code"],
                                               {"error": line["error"]})
                self.store.record(self.batch_id, number, entry, "failed")
                todo.popleft()
                continue
            rid = request_id(self.batch_id, number)
            try:
                loop.run(queue.enqueue(QueuedRequest(id=rid, priority=priority, **line["request"]), self.fields))
            except QueueRefused as refused:
                if refused.code is not QueueError.DUPLICATE:
                    return  # shed (the queue is full at this priority): the line waits for a later turn
                # DUPLICATE: queued by an earlier run of this job; follow its stream from the start
            todo.popleft()
            inflight[rid] = Flight(number, line["custom_id"], rid, reading=line.get("reading", {}),
                                   answers=Choices(int(line["request"].get("n", 1))))

    def _take(self, flight: Flight, entries: list, stopping: BatchStatus | None) -> bool:
        """Read a line's events; True when it ended (its result is recorded)."""
        for entry_id, event in entries:
            flight.after = entry_id
            if isinstance(event, (Token, Done)):
                if not flight.answers.add(event):
                    continue
                body = results.answer_body(self.endpoint, flight.rid, self.model, int(self._now()),
                                           flight.answers.answers(), flight.reading)
                entry = results.response_entry(self.batch_id, flight.line, flight.custom_id, 200, body)
                self.store.record(self.batch_id, flight.line, entry, "completed")
                return True
            elif isinstance(event, Failed):
                if event.code == "cancelled" and stopping:
                    self._record_unrun(flight.line, flight.custom_id, stopping)
                else:
                    status, body = results.failure_body(event)
                    entry = results.response_entry(self.batch_id, flight.line, flight.custom_id, status, body)
                    self.store.record(self.batch_id, flight.line, entry, "failed")
                return True
        return False

    def _drop_cancelled(self, statuses: dict[str, str | None], inflight: dict[str, Flight],
                        stopping: BatchStatus) -> None:
        """A running request that was cancelled ends without an event: its status says so."""
        for rid, status in statuses.items():
            if status in (None, RequestStatus.CANCELLED):
                flight = inflight.pop(rid)
                self._record_unrun(flight.line, flight.custom_id, stopping)

    def _record_unrun(self, line: int, custom_id: str, stopping: BatchStatus) -> None:
        why = "The batch was cancelled" if stopping == BatchStatus.CANCELLED else "The batch expired"
        entry = results.unrun_entry(self.batch_id, line, custom_id, f"batch_{stopping}",
                                    f"{why} before this request completed.")
        self.store.record(self.batch_id, line, entry, "")

    # -- the end ------------------------------------------------------------------------------
    def _finish(self, stopping: BatchStatus | None) -> str:
        batch_id = self.batch_id
        if stopping is None:
            after = self.store.advance(batch_id, (BatchStatus.IN_PROGRESS,), BatchStatus.FINALIZING,
                                       "finalizing_at", self._now())
            if after == BatchStatus.CANCELLING:
                stopping = BatchStatus.CANCELLED  # every line ended before the cancel mattered
        if stopping:
            total = int(self.store.get(batch_id)["total"])
            missing = [n for n in range(total) if n not in self.store.recorded(batch_id)]
            for number, raw in zip(missing, self.store.lines(batch_id, missing)):
                self._record_unrun(number, json.loads(raw)["custom_id"], stopping)
        self._renew()
        self._write_files()
        if stopping == BatchStatus.CANCELLED:
            return self.store.advance(batch_id, (BatchStatus.CANCELLING,), BatchStatus.CANCELLED, "cancelled_at",
                                      self._now())
        if stopping == BatchStatus.EXPIRED:
            return self.store.advance(batch_id, (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING),
                                      BatchStatus.EXPIRED, "expired_at", self._now())
        return self.store.advance(batch_id, (BatchStatus.FINALIZING,), BatchStatus.COMPLETED, "completed_at",
                                  self._now())

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
    """The RQ job (batches.handoff.JOB_FUNCTION). Settings come from STRATA_ variables."""
    settings = BatchWorkerSettings()
    client = connect(settings.redis_url, cluster=settings.redis_cluster, decode_responses=False)
    try:
        status = BatchRun(client, batch_id, settings).run()
        log.info("batch %s: %s", batch_id, status)
        return status
    finally:
        client.close()
