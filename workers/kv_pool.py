"""The worker's KV pool in use: workers/blocks.py's bookkeeping kept in step with the engine's
block tables. The loop calls it around every engine call that writes entries: `grow` before (the
engine's table must hold the positions it writes), `wrote` after (what the blocks now hold, so full
prompt blocks are keyed for later requests), `start` when a request takes a slot (its cached
prefix, the read starts after it) and `free` when it leaves the slot.

Only prompt tokens read as a prompt is read are keyed: a decode step's entries (and a resumed
answer's, replayed as decode steps) come from other kernels than a cold read of the same text,
so a later prompt reusing them would not get a cold run's logits (docs/engine.md, "Exact repeats")."""

from __future__ import annotations

from typing import Protocol, Sequence

from workers.admission import never_fits
from workers.blocks import BlockPool


class PagedEngine(Protocol):
    num_slots: int
    ctx: int
    kv_tokens: int
    kv_block: int

    def assign(self, slot: int, blocks: Sequence[int], tokens: Sequence[int] | None = None) -> None: ...


class KvPool:
    def __init__(self, engine: PagedEngine) -> None:
        self.engine = engine
        self.blocks = BlockPool(engine.kv_tokens, engine.kv_block, engine.num_slots)
        # decode rows a slot may write ahead of its position in one step (the engine's guesses)
        self.lookahead = engine.num_slots

    @property
    def max_tokens(self) -> int:
        return self.blocks.max_tokens

    def blocks_needed(self, prompt: Sequence[int], max_tokens: int, n: int = 1) -> int:
        """What admitting the request takes from the free blocks; n answers: each sibling its own
        whole reservation (they share the read's blocks only once it is done: `share_read`)."""
        return self.blocks.blocks_needed(prompt, max_tokens) + (n - 1) * self.blocks.blocks_for(len(prompt) + max_tokens)

    def never_fits(self, prompt: Sequence[int], max_tokens: int) -> str | None:
        """Why no state of this pool could ever hold the request (it must fail, not wait)."""
        return never_fits(len(prompt), max_tokens, self.engine.ctx, self.blocks.max_tokens)

    def start(self, slot: int, prompt: Sequence[int], max_tokens: int, priority: int, use_cache: bool) -> int:
        """The slot's request: its cached prefix blocks and its reservation. Returns the prompt
        tokens already cached (whoever computed them): the read starts there."""
        cached = self.blocks.allocate(slot, prompt, max_tokens, priority, use_cache=use_cache)
        table = self.blocks.tables[slot]
        self.engine.assign(slot, table.blocks, table.tokens)
        return cached

    def catch_up(self, slot: int, prompt: Sequence[int]) -> int:
        """Before the slot reads on: the cached blocks that continue what it holds (another slot's
        read keyed them since), into its table and the engine's. Returns the tokens it now holds,
        or 0 when nothing was adopted (the read goes on as it was)."""
        if not self.blocks.catch_up(slot, prompt):
            return 0
        table = self.blocks.tables[slot]
        self.engine.assign(slot, table.blocks, table.tokens)
        return len(table.tokens)

    def grow(self, slot: int, num_tokens: int) -> None:
        """Before the engine writes the slot's positions up to num_tokens - 1."""
        if self.blocks.grow(slot, num_tokens):
            self.engine.assign(slot, self.blocks.tables[slot].blocks)

    def grow_for_decode(self, slot: int) -> None:
        """Before a decode step: the row's position and the guesses after it."""
        self.grow(slot, len(self.blocks.tables[slot].tokens) + self.lookahead)

    def wrote(self, slot: int, tokens: Sequence[int], keyable: bool) -> None:
        self.blocks.write(slot, tokens, keyable=keyable)

    def share_read(self, target: int, source: int, max_tokens: int, priority: int) -> None:
        """n answers: the source slot's read is done; the target (a sibling, holding a
        reservation) takes its full prompt blocks as a cached prefix instead, and blocks of its own
        for the rest, which the engine's fork copies (`copied`). Fits: the sibling gives back more
        than it takes."""
        prompt = self.blocks.tables[source].tokens
        self.blocks.free(target)
        self.blocks.allocate(target, prompt, max_tokens, priority)
        table = self.blocks.tables[target]
        self.blocks.grow(target, len(prompt))
        self.engine.assign(target, table.blocks, table.tokens)

    def copied(self, target: int, source: int) -> None:
        """The engine copied the source's entries into the target's blocks: what they now hold."""
        table = self.blocks.tables[target]
        self.blocks.write(target, self.blocks.tables[source].tokens[len(table.tokens):])

    def cached_tokens(self, slot: int) -> int:
        return self.blocks.tables[slot].num_cached_tokens

    def free(self, slot: int) -> None:
        if slot in self.blocks.tables:
            self.blocks.free(slot)
            self.engine.assign(slot, [])
