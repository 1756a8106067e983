"""One blocking XREAD for every answer this API process follows, instead of one per answer.

Each open answer (stream, whole answer, re-attach) used to wait in an XREAD of its own: a Redis
connection per answer and, while they wait, a command per answer every read_block_ms. 2 000 idle
streams took half a core of the API and 2 000 connections (bench/load.py). Here one loop reads
them all at once (their streams share the model's hash tag, so this holds on Redis Cluster too)
and hands each follower the events after the last one it has.

A follower that has just joined reads for itself until the shared loop's next round includes it:
the loop may be blocked in an XREAD that does not name it, and its first token must not wait for
that round to end."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from queues.connect import UNAVAILABLE
from queues.intake import Intake
from queues.records import Event

log = logging.getLogger("strata.api")

Entry = tuple[str, Event]
OUTAGE_POLL_S = 0.5  # how often the loop tries Redis again while it is away


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Follower:
    """One reader of one request's output, from entry id `after` on."""

    def __init__(self, request_id: str, after: str) -> None:
        self.request_id = request_id
        self.after = after
        self.adopted = False  # the shared loop's current round reads for it
        self._pending: list[Entry] = []
        self._error: Exception | None = None
        self._ready = anyio.Event()

    def take(self, entries: list[Entry]) -> list[Entry]:
        """The entries it has not had yet (the shared loop and its own read may both bring one)."""
        fresh = [e for e in entries if _order(e[0]) > _order(self.after)]
        if fresh:
            self.after = fresh[-1][0]
        return fresh

    def deliver(self, entries: list[Entry]) -> None:
        fresh = self.take(entries)
        if fresh:
            self._pending += fresh
            self._ready.set()

    def fail(self, error: Exception) -> None:
        """The shared read failed: its next() raises until a round succeeds."""
        self._error = error
        self._ready.set()


class SharedReader:
    def __init__(self, intake: Intake, block_ms: int) -> None:
        self.intake = intake
        self.block_ms = block_ms
        self._followers: dict[str, set[Follower]] = defaultdict(set)
        self._joined = anyio.Event()

    @asynccontextmanager
    async def follow(self, request_id: str, after: str = "0-0") -> AsyncIterator[Follower]:
        follower = Follower(request_id, after)
        self._followers[request_id].add(follower)
        self._joined.set()
        try:
            yield follower
        finally:
            followers = self._followers.get(request_id)
            if followers is not None:
                followers.discard(follower)
                if not followers:
                    del self._followers[request_id]

    async def next(self, follower: Follower, block_ms: int) -> list[Entry]:
        """The follower's new events; empty when none came within block_ms. Raises UNAVAILABLE
        when Redis could not be read."""
        fresh: list[Entry] = []
        if not follower.adopted:
            fresh = follower.take(await self.intake.read(follower.request_id, follower.after, block_ms))
        else:
            if follower._error is None:
                with anyio.move_on_after(block_ms / 1000):
                    await follower._ready.wait()
            if follower._error is not None:  # kept until a round succeeds: the outage lasts that long
                follower._ready = anyio.Event()
                raise follower._error
        # what the loop delivered while its own read was under way comes first: it is older
        batch, follower._pending = follower._pending + fresh, []
        follower._ready = anyio.Event()
        return batch

    async def run(self) -> None:
        """The app's lifetime: one XREAD after another over every followed stream."""
        while True:
            if not self._followers:
                await self._joined.wait()
            self._joined = anyio.Event()
            after: dict[str, str] = {}
            for request_id, followers in self._followers.items():
                for follower in followers:
                    follower.adopted = True
                after[request_id] = min((f.after for f in followers), key=_order)
            try:
                found = await self.intake.read_many(after, self.block_ms)
            except Exception as error:  # noqa: BLE001 - Redis away (UNAVAILABLE), or a bug: the loop must go on
                if not isinstance(error, UNAVAILABLE):
                    log.exception("reading the output streams failed")
                for followers in self._followers.values():
                    for follower in followers:
                        follower.fail(error)
                await anyio.sleep(OUTAGE_POLL_S)
                continue
            for followers in self._followers.values():
                for follower in followers:
                    follower._error = None
            for request_id, entries in found.items():
                for follower in self._followers.get(request_id, ()):
                    follower.deliver(entries)
