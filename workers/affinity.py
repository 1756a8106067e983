"""Which prompt prefixes this worker holds, as the affinity keys (queues/affinity.py) it
advertises in its worker hash (`prefixes`): no Redis, no torch, no clock.

A prefix is held while a request with it is in a slot (its read in progress included: a request
admitted beside it adopts what that read keys, workers/blocks.py `catch_up`), and afterwards while
the KV pool still caches the block closing it (or, with no pool, while a free slot's cache starts
with it: rule 9's conversation cache). At most ADVERTISED keys, newest first: the worker hash stays
small and a stale key costs another worker at most the affinity wait."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from queues.affinity import affinity_key, span
from queues.records import QueuedRequest
from workers.blocks import BlockPool
from workers.slot import Slot

ADVERTISED = 32


class HeldPrefixes:
    def __init__(self, limit: int = ADVERTISED) -> None:
        self.limit = limit
        # key -> (the pool's key of its last whole block, or None; the prefix's tokens), oldest first
        self._recent: OrderedDict[str, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()
        self._of_request: dict[str, str | None] = {}  # request id -> its key, for the requests in slots

    def key_of(self, request: QueuedRequest) -> str | None:
        if request.id not in self._of_request:
            if len(self._of_request) > 4 * self.limit:
                self._of_request.clear()
            self._of_request[request.id] = affinity_key(request.prompt)
        return self._of_request[request.id]

    def note(self, request: QueuedRequest, pool: BlockPool | None) -> None:
        """A request took a slot here: its prefix is held from now on."""
        key = self.key_of(request)
        if key is None:
            return
        prefix = tuple(request.prompt[: span(len(request.prompt))])
        self._recent[key] = (pool.prefix_key(prefix) if pool is not None else None, prefix)
        self._recent.move_to_end(key)
        while len(self._recent) > self.limit:
            self._recent.popitem(last=False)

    def held(self, slots: Sequence[Slot], pool: BlockPool | None) -> list[str]:
        """The keys to advertise, newest first: those of the requests in slots, then those still
        cached, at most `limit`."""
        keys: dict[str, None] = {}
        for slot in slots:
            if slot.request is not None:
                key = self.key_of(slot.request)
                if key is not None:
                    keys[key] = None
        for key, (block_key, prefix) in reversed(self._recent.items()):
            if len(keys) >= self.limit:
                break
            if key in keys:
                continue
            if pool is not None:
                cached = block_key is not None and pool.is_cached(block_key)
            else:
                cached = any(s.is_free and tuple(s.cached[: len(prefix)]) == prefix for s in slots)
            if cached:
                keys[key] = None
        return list(keys)[: self.limit]
