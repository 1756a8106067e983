"""The simulator's side of the queue (simulate/): enqueue a request at a given (virtual) time
through the very enqueue.lua the API uses, and collect the requests that ended, with the
timings the workers wrote on their hashes, deleting them so an hour of traffic does not pile up
in memory. Synchronous: the simulation is one thread."""

from __future__ import annotations

from typing import Sequence

import redis
import redis.exceptions

from queues import scripts
from queues.keys import Keys
from queues.lifecycle import FINAL
from queues.records import QueuedRequest, text
from queues.scripts import QueueError

RECORD_FIELDS = ("status", "priority", "enqueued_ms", "claimed_ms", "first_token_ms", "finished_ms",
                 "completion_tokens", "yields", "finish_reason", "worker", "claim_seq")


class Replay:
    def __init__(self, client: redis.Redis, model: str, *, max_waiting: int = 0, hard_limit: int = 0) -> None:
        self.client = client
        self.keys = Keys(model)
        self.max_waiting = max_waiting
        self.hard_limit = hard_limit
        self._scripts = scripts.register(client)

    def enqueue(self, request: QueuedRequest, now_ms: int, queue_timeout_ms: int | None = None) -> bool:
        """False when the queue shed it (the API's 429)."""
        call = scripts.enqueue(self.keys, request, now_ms, self.max_waiting, self.hard_limit,
                               queue_timeout_ms=queue_timeout_ms)
        try:
            scripts.run(self._scripts, call)
        except redis.exceptions.ResponseError as error:
            refused = scripts.refused(error)
            if refused and refused.code is QueueError.QUEUE_FULL:
                return False
            raise
        return True

    def take_ended(self, request_ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """The records (RECORD_FIELDS) of those requests that ended; their keys are deleted."""
        pipe = self.client.pipeline(transaction=False)
        for rid in request_ids:
            pipe.hmget(self.keys.req(rid), RECORD_FIELDS)
        ended = {}
        for rid, values in zip(request_ids, pipe.execute()):
            record = {name: text(v) for name, v in zip(RECORD_FIELDS, values) if v is not None}
            if record.get("status") in FINAL:
                ended[rid] = record
        if ended:
            self.client.delete(*[k for rid in ended for k in (self.keys.req(rid), self.keys.out(rid))])
        return ended

    def waiting(self) -> int:
        return int(self.client.zcard(self.keys.waiting))
