"""The worker's KV pool as bookkeeping: which block of the pool holds which tokens of which slot.
No torch, no Redis, no clock; the engine's paged attention reads the block tables it hands out.

The pool is `--kv-tokens` tokens in blocks of `block_size`. A slot's block table lists its blocks
in token order. A block that is full is keyed by the hash of the whole prefix it closes (a chain:
its hash covers its parent's hash and its own token ids), so one lookup per block finds the longest
cached prefix of a new prompt, whoever computed it. Blocks are reference-counted; one no slot
references keeps its tokens (cached) until its memory is needed.

Memory is promised, never taken back: `allocate` reserves every block a request can ever use
(prompt + max_tokens, minus the cached blocks it shares), so a decode never runs out of blocks
and nothing is preempted. Reserved blocks are a count, not particular blocks: until a slot writes
into them they may still hold cached prefixes.

Eviction order, exactly: an unreferenced cached block is evicted only when an empty block is not
left; among them the lowest `priority` goes first (a block's priority is the highest priority of
the requests that have referenced it since it was computed), then the one released longest ago,
then the lowest block id. A slot releases its blocks last-first, and an ancestor block is
referenced by every request of its descendants, so an ancestor never goes before a descendant:
the cache never holds a block its own prefix cannot reach.

Placement, when the pool knows its slots (`num_slots`): each slot has a home, an equal share of
the pool in slot order (where the engine's tables start out, engine/model.py), and a block it takes
is the one after its last, or its home for its first, when that one is empty; else the empty
block it would take without placement (the lowest id at first, then the last freed), and an
evictable block only in eviction order, never out of it. So each slot's
blocks tend to be one run, the runs equally spaced: an eager decode step then reads them as one
strided view of each pool instead of a gather (`Transformer.kv_view`).

A block is keyed once its KV is written, never before: two requests with one new prefix both
find nothing at allocate. The worker's reads take the lines one at a time, so the second does not
read the prefix again: as it takes the lines it first `catch_up`s, adopting the blocks the first's
read keyed meanwhile. Nothing waits on a block that is not written yet, so nothing is stranded
when a read is cancelled, moved or its worker dies: whoever reads next reads what is not cached.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from dataclasses import dataclass, field
from typing import Sequence

NO_PRIORITY = -(2**63)  # an empty block's priority: below every request's


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its prefix's key and its own token ids (stable across processes,
    unlike hash(), so a worker hash or a log may name it)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and computed (cached)
    priority: int = NO_PRIORITY
    released_at: int = 0  # the pool's release counter when its last reference went


@dataclass
class Table:
    """One slot's blocks, and what they hold."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # token ids whose KV is written, in order
    num_reserved: int = 0  # blocks promised and not yet taken
    priority: int = 0
    num_cached_tokens: int = 0  # the prompt's tokens found in the cache (at allocate, or caught up)
    uses_cache: bool = True  # off: a read that must see every position itself (allocate's use_cache)
    # whether its full blocks may still be keyed: not once it wrote a token the way a prompt read
    # would not (a decode step's, a replayed answer's: other kernels, other entries), nor after
    is_keyable: bool = True


class BlockPool:
    def __init__(self, num_tokens: int, block_size: int = 16, num_slots: int = 0) -> None:
        """num_slots: the slots' homes for placement (0: none, the lowest empty id first)."""
        if block_size < 1 or num_tokens < block_size:
            raise ValueError(f"a pool of {num_tokens} tokens cannot hold one block of {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_tokens // block_size)]
        self.tables: dict[int, Table] = {}
        self.home_blocks = len(self.blocks) // num_slots if num_slots else 0  # a home's share
        # Empty blocks: the set is the truth; the stack (pop() gives the lowest id, then the last
        # freed) may hold ids since taken by placement, skipped when popped.
        self._empty_ids: set[int] = set(range(len(self.blocks)))
        self._empty: list[int] = list(range(len(self.blocks) - 1, -1, -1))
        self._by_hash: dict[bytes, int] = {}
        self._evictable: list[tuple[int, int, int]] = []  # heap of (priority, released_at, id), stale ones skipped
        self._num_evictable = 0
        self._num_reserved = 0
        self._releases = 0

    # -- counters ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_used(self) -> int:
        """Blocks some slot references."""
        return self.num_blocks - len(self._empty_ids) - self._num_evictable

    @property
    def num_reserved(self) -> int:
        """Blocks promised to admitted requests and not yet written."""
        return self._num_reserved

    @property
    def num_free(self) -> int:
        """What admission may still promise: empty blocks and unreferenced cached ones, less the
        reserved. num_free + num_used + num_reserved == num_blocks."""
        return len(self._empty_ids) + self._num_evictable - self._num_reserved

    @property
    def num_cached(self) -> int:
        """Blocks holding a prefix a new prompt may reuse (referenced or not)."""
        return len(self._by_hash)

    @property
    def num_shared(self) -> int:
        """Blocks more than one slot references now."""
        return sum(1 for b in self.blocks if b.ref_count > 1)

    # -- admission --------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_blocks(self, prompt: Sequence[int]) -> list[int]:
        """The cached blocks of the longest cached prefix of the prompt. The prompt's last token is
        always read again (its logits give the first answer token), so only blocks within
        prompt[:-1] count."""
        return self._cached_after(prompt, 0, None)

    def prefix_key(self, tokens: Sequence[int]) -> bytes | None:
        """The key the block closing the last whole block of `tokens` has once cached (its chain
        covers every block before it); None when `tokens` is shorter than a block."""
        key = None
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            key = block_hash(key, tokens[start : start + bs])
        return key

    def is_cached(self, key: bytes) -> bool:
        """A block of that key is cached: so is the whole prefix it closes (an ancestor is never
        evicted before its descendant)."""
        return key in self._by_hash

    def _cached_after(self, prompt: Sequence[int], start: int, parent: bytes | None) -> list[int]:
        """cached_blocks from the block at `start`, whose parent's hash is `parent`."""
        found: list[int] = []
        bs = self.block_size
        for start in range(start, len(prompt) - 1 - bs + 1, bs):
            parent = block_hash(parent, prompt[start : start + bs])
            block = self._by_hash.get(parent)
            if block is None:
                break
            found.append(block)
        return found

    def blocks_needed(self, prompt: Sequence[int], max_tokens: int) -> int:
        """The free blocks (num_free) admitting this request would take: all it may ever use, less
        the cached blocks it shares that some slot already holds (an unreferenced cached block it
        reuses still leaves the free count)."""
        total = self.blocks_for(len(prompt) + max_tokens)
        in_use = sum(1 for b in self.cached_blocks(prompt) if self.blocks[b].ref_count > 0)
        return total - in_use

    def can_allocate(self, prompt: Sequence[int], max_tokens: int) -> bool:
        return self.blocks_needed(prompt, max_tokens) <= self.num_free

    def allocate(self, slot: int, prompt: Sequence[int], max_tokens: int, priority: int,
                 use_cache: bool = True) -> int:
        """Give the slot the cached blocks of its prompt and reserve the rest of what it may use.
        Returns the prompt tokens already in the cache: the read starts there. use_cache off: none
        (a read that must see every position itself, prompt scoring)."""
        if slot in self.tables:
            raise ValueError(f"slot {slot} already holds blocks")
        if not self.can_allocate(prompt, max_tokens):
            need = self.blocks_needed(prompt, max_tokens)
            raise ValueError(f"slot {slot}: {need} blocks needed, {self.num_free} free")
        hits = self.cached_blocks(prompt) if use_cache else []
        table = Table(priority=priority, uses_cache=use_cache)
        for b in hits:
            self._reference(b, priority)
            table.blocks.append(b)
        table.tokens = list(prompt[: len(hits) * self.block_size])
        table.num_cached_tokens = len(table.tokens)
        table.num_reserved = self.blocks_for(len(prompt) + max_tokens) - len(hits)
        self._num_reserved += table.num_reserved
        self.tables[slot] = table
        return table.num_cached_tokens

    def catch_up(self, slot: int, prompt: Sequence[int]) -> int:
        """The slot is about to read its prompt on from what its table holds: take the cached
        blocks that continue it (keyed since it was admitted: another slot's read of the same prefix
        got there first) instead of reading them again. Only at a block's edge with nothing but its
        prompt written; the adopted blocks come out of its reservation. Returns the tokens adopted:
        the read moves on by that many."""
        table = self.tables[slot]
        held = len(table.tokens)
        if (not table.uses_cache or not table.is_keyable or held % self.block_size
                or len(table.blocks) != held // self.block_size):
            return 0
        parent = self.blocks[table.blocks[-1]].hash if table.blocks else None
        if (table.blocks and parent is None) or list(prompt[:held]) != table.tokens:
            return 0  # its last block is private (no cached block follows it), or it holds another text
        more = self._cached_after(prompt, held, parent)  # from its own last block on, not the prompt's start
        for b in more:
            self._reference(b, table.priority)
            table.blocks.append(b)
        table.num_reserved -= len(more)
        self._num_reserved -= len(more)
        adopted = len(more) * self.block_size
        table.tokens.extend(prompt[held : held + adopted])
        table.num_cached_tokens += adopted
        return adopted

    # -- writing ----------------------------------------------------------------------------
    def room(self, slot: int) -> int:
        """The most tokens the slot may hold: its blocks and its reservation."""
        table = self.tables[slot]
        return (len(table.blocks) + table.num_reserved) * self.block_size

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Take blocks from the slot's reservation until its table holds `num_tokens` positions
        (at most its room): what the engine must have before it writes them. True if it grew."""
        table = self.tables[slot]
        want = min(self.blocks_for(num_tokens), len(table.blocks) + table.num_reserved)
        grew = False
        while len(table.blocks) < want:
            table.num_reserved -= 1
            self._num_reserved -= 1
            b = self._take(self._placed(slot, table))
            self._reference(b, table.priority)
            table.blocks.append(b)
            grew = True
        return grew

    def write(self, slot: int, tokens: Sequence[int], keyable: bool = True) -> None:
        """The engine wrote the KV of these tokens after the slot's others (a read chunk, or one
        decode step's token): take blocks from the reservation as needed, and key every block
        that is now full, so later prompts find it. keyable off: entries a prompt read would not
        have made (decode steps'); neither their block nor any after it is keyed."""
        table = self.tables[slot]
        bs = self.block_size
        room = self.room(slot)
        if len(table.tokens) + len(tokens) > room:
            raise ValueError(f"slot {slot} writes beyond the {room} tokens it reserved")
        self.grow(slot, len(table.tokens) + len(tokens))
        if not keyable and tokens:
            table.is_keyable = False
        for token in tokens:
            table.tokens.append(token)
            if len(table.tokens) % bs == 0 and table.is_keyable:
                self._seal(table)

    def _seal(self, table: Table) -> None:
        """The table's last block just filled: key it, unless an equal block is cached already
        (two slots read the same prefix at once); then this one stays private and goes back
        empty when freed."""
        full = len(table.tokens) // self.block_size
        parent = self.blocks[table.blocks[full - 2]].hash if full > 1 else None
        if full > 1 and parent is None:
            return  # its parent is a private duplicate: a lookup cannot reach this block
        key = block_hash(parent, table.tokens[-self.block_size :])
        if key not in self._by_hash:
            self._by_hash[key] = table.blocks[full - 1]
            self.blocks[table.blocks[full - 1]].hash = key

    # -- freeing ----------------------------------------------------------------------------
    def free(self, slot: int) -> None:
        """The slot's request ended (or moved to another worker): drop its references, last block
        first, and give back what it reserved and did not use."""
        table = self.tables.pop(slot)
        self._num_reserved -= table.num_reserved
        for b in reversed(table.blocks):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self._releases += 1
            block.released_at = self._releases
            if block.hash is None:
                block.priority = NO_PRIORITY
                self._empty_ids.add(b)
                self._empty.append(b)
            else:
                heapq.heappush(self._evictable, (block.priority, block.released_at, b))
                self._num_evictable += 1
        if len(self._evictable) > 2 * self.num_blocks:  # stale entries of re-referenced blocks
            self._evictable = [e for e in self._evictable if self._is_live(e)]
            heapq.heapify(self._evictable)

    # -- internals --------------------------------------------------------------------------
    def _reference(self, b: int, priority: int) -> None:
        block = self.blocks[b]
        if block.ref_count == 0 and block.hash is not None:
            self._num_evictable -= 1  # its heap entry goes stale: skipped when popped
        block.ref_count += 1
        block.priority = max(block.priority, priority)

    def _placed(self, slot: int, table: Table) -> int | None:
        """The block placement would give the slot next: after its last, or its home."""
        if not self.home_blocks:
            return None
        return table.blocks[-1] + 1 if table.blocks else slot * self.home_blocks

    def _take(self, preferred: int | None = None) -> int:
        """The preferred block if it is empty, else an empty block, else the first unreferenced
        cached one in eviction order."""
        if preferred in self._empty_ids:
            self._empty_ids.remove(preferred)
            if len(self._empty) > 2 * self.num_blocks:  # the stack's stale ids
                self._empty = [b for b in self._empty if b in self._empty_ids]
            return preferred
        while self._empty:
            b = self._empty.pop()
            if b in self._empty_ids:
                self._empty_ids.remove(b)
                return b
        while self._evictable:
            entry = heapq.heappop(self._evictable)
            if self._is_live(entry):
                block = self.blocks[entry[2]]
                self._num_evictable -= 1
                del self._by_hash[block.hash]
                block.hash = None
                block.priority = NO_PRIORITY
                return block.id
        raise RuntimeError("the pool has no block left: a reservation was not kept")  # a bug, not a full pool

    def _is_live(self, entry: tuple[int, int, int]) -> bool:
        """A heap entry still describes its block: unreferenced and cached since that release."""
        block = self.blocks[entry[2]]
        return block.ref_count == 0 and block.hash is not None and (block.priority, block.released_at) == entry[:2]

    def eviction_order(self) -> list[int]:
        """The unreferenced cached blocks in the order they would be evicted (for tests and the
        operator's view)."""
        live = [b for b in self.blocks if b.ref_count == 0 and b.hash is not None]
        return [b.id for b in sorted(live, key=lambda b: (b.priority, b.released_at, b.id))]
