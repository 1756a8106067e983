"""The client side of one model's queue: enqueue a request, read its output back, cancel it.
The API uses it for every request; the batch job (sync, under RQ) drives the very same code for
its lines from an event loop of its own (batches/job.py)."""

from __future__ import annotations

import time
from typing import Callable

import redis.asyncio as aioredis
import redis.exceptions

from queues import scripts
from queues.keys import Keys
from queues.lifecycle import RequestStatus
from queues.records import Event, QueuedRequest, decoded, events, text
from queues.scripts import ExpireResult


def now_ms() -> int:
    return int(time.time() * 1000)


class Intake:
    def __init__(
        self,
        client: aioredis.Redis,
        model: str,
        *,
        max_waiting: int = 0,
        hard_limit: int = 0,
        retention_s: int = 3600,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.client = client
        self.keys = Keys(model)
        self.max_waiting = max_waiting
        self.hard_limit = hard_limit
        self.retention_s = retention_s
        self.clock = clock
        self._scripts = scripts.register(client)

    async def enqueue(self, request: QueuedRequest, fields: dict[str, str] | None = None,
                      queue_timeout_ms: int | None = None) -> int:
        """Add a request; returns how many wait ahead of it. Raises QueueRefused: QUEUE_FULL when
        shed, DUPLICATE when a request of that id exists. `fields` are written on the request
        hash too (e.g. `key_name`: who asked, for operators). Not claimed within
        `queue_timeout_ms`, it expires (None: no limit)."""
        call = scripts.enqueue(self.keys, request, self.clock(), self.max_waiting, self.hard_limit, fields,
                               queue_timeout_ms)
        try:
            _member, ahead = await scripts.run(self._scripts, call)
        except redis.exceptions.ResponseError as error:
            refused = scripts.refused(error)
            if refused:
                raise refused from None
            raise
        return int(ahead)

    async def read(
        self, request_id: str, after: str = "0-0", block_ms: int = 1000
    ) -> list[tuple[str, Event]]:
        """Output events after entry id `after` (empty when none came within block_ms).
        Entry ids are the stream's own, so a client can resume from the last one it saw."""
        return (await self.read_many({request_id: after}, block_ms)).get(request_id, [])

    async def read_many(self, after: dict[str, str], block_ms: int) -> dict[str, list[tuple[str, Event]]]:
        """Events of several requests (request id -> entry id read so far) in one XREAD: their
        streams share the model's hash tag. Requests with nothing new are left out."""
        if not after:
            return {}
        by_stream = {self.keys.out(rid): rid for rid in after}
        reply = await self.client.xread({self.keys.out(rid): entry for rid, entry in after.items()},
                                        block=block_ms, count=256)
        found: dict[str, list[tuple[str, Event]]] = {}
        for stream, entries in reply or []:
            found[by_stream[text(stream)]] = events(entries)
        return found

    async def record(self, request_id: str) -> dict[str, str] | None:
        """The request's hash (None: unknown, or expired past its retention)."""
        found = await self.client.hgetall(self.keys.req(request_id))
        return decoded(found) if found else None

    async def events(self, request_id: str, after: str = "0-0", count: int | None = None) -> list[tuple[str, Event]]:
        """The output events already in the stream after entry id `after`, without waiting."""
        entries = await self.client.xrange(self.keys.out(request_id), min=f"({after}", count=count)
        return events(entries)

    async def cancel(self, request_id: str) -> RequestStatus | None:
        """The status the request had (None: unknown): cancel.lua's answer."""
        status = text(await scripts.run(self._scripts, scripts.cancel(self.keys, request_id, self.clock(),
                                                                      self.retention_s)))
        return RequestStatus(status) if status else None

    async def statuses(self, request_ids: list[str]) -> dict[str, str | None]:
        """Each request's status (None: its record is gone)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for rid in request_ids:
                pipe.hget(self.keys.req(rid), "status")
            replies = await pipe.execute()
        return {rid: None if s is None else text(s) for rid, s in zip(request_ids, replies)}

    async def expire_if_overdue(self, request_id: str) -> bool:
        """The request expires now if it still waits for its first claim past its deadline: the
        API does this for its own client, so a request expires on time even with no worker alive."""
        call = scripts.expire(self.keys, request_id, self.clock(), self.retention_s)
        return ExpireResult(int(await scripts.run(self._scripts, call))) is ExpireResult.EXPIRED
