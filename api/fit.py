"""What fits: the API plans a request's answer length against the context the workers publish
(their `ctx` field: what one request may hold there) as well as its own cap (--max-model-len, else
the model's own context), the smaller of the two, and against the smallest KV pool they publish
(a request beyond a whole pool could never run), so it never accepts what a worker cannot hold;
and its `n` against the most slots one worker has (`slots_total`). Read at most every `ttl_ms`
(not once per request); the cap alone until a live worker has said."""

from __future__ import annotations

from typing import Callable

import anyio
import redis.asyncio as aioredis

from queues import membership


class Fit:
    def __init__(self, client: aioredis.Redis, model: str, fallback: int, live_within_ms: int,
                 clock: Callable[[], int], ttl_ms: int = 2000) -> None:
        self.client = client
        self.model = model
        self.fallback = fallback  # --max-model-len or the model's context: also a cap
        self.live_within_ms = live_within_ms
        self.clock = clock
        self.ttl_ms = ttl_ms
        self._ctx = fallback
        self._pool: int | None = None
        self._slots: int | None = None
        self._read_ms: int | None = None
        self._refreshing: anyio.Event | None = None  # set when the read in flight has ended

    async def limits(self) -> tuple[int, int | None, int | None]:
        """(ctx, pool, slots): the context one request may hold (the smaller of the cap and the
        smallest a live worker publishes); the smallest live worker's KV pool in tokens (a request
        beyond it never runs); the most slots one live worker has (n answers take n of one
        worker's). Pool and slots are None until a live worker has said."""
        await self._refresh()
        return self._ctx, self._pool, self._slots

    async def _refresh(self) -> None:
        # The requests that arrive while a read is in flight wait for that read instead of each
        # sending its own: under load every request of those milliseconds used to read again.
        # A read that failed leaves the facts stale, and the next one in line reads itself.
        while True:
            now = self.clock()
            if self._read_ms is not None and now - self._read_ms < self.ttl_ms:
                return
            if self._refreshing is None:
                break
            await self._refreshing.wait()
        self._refreshing = done = anyio.Event()
        try:
            published, self._pool, self._slots = await membership.live_facts(
                self.client, self.model, now, self.live_within_ms)
            self._ctx = min(published or self.fallback, self.fallback)
            self._read_ms = now
        finally:
            self._refreshing = None
            done.set()
