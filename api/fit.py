"""What fits: the API plans a request's answer length against the context the workers publish
(their `ctx` field: what one request may hold there) as well as its own cap (--max-model-len, else
the model's own context), the smaller of the two, and against the smallest KV pool they publish
(a request beyond a whole pool could never run), so it never accepts what a worker cannot hold;
and its `n` against the most slots one worker has (`slots_total`). Read at most every `ttl_ms`
(not once per request); the cap alone until a live worker has said."""

from __future__ import annotations

from typing import Callable

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

    async def ctx(self) -> int:
        await self._refresh()
        return self._ctx

    async def pool(self) -> int | None:
        """The smallest live worker's KV pool in tokens (a request beyond it never runs); None until one has said."""
        await self._refresh()
        return self._pool

    async def slots(self) -> int | None:
        """The most slots one live worker has (n answers take n of one worker's); None until one has said."""
        await self._refresh()
        return self._slots

    async def _refresh(self) -> None:
        now = self.clock()
        if self._read_ms is None or now - self._read_ms >= self.ttl_ms:
            published, self._pool = await membership.live_limits(self.client, self.model, now, self.live_within_ms)
            self._ctx = min(published or self.fallback, self.fallback)
            self._slots = await membership.live_slots(self.client, self.model, now, self.live_within_ms)
            self._read_ms = now
