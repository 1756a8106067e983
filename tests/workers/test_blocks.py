"""The KV pool's bookkeeping (tier 1): allocation, prefix sharing, refcounts, eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.blocks import BlockPool, block_hash

BS = 4


def tokens(*blocks: int, tail: int = 1) -> list[int]:
    """A prompt of whole blocks named by a number each (block n = [n] * BS), then `tail` tokens
    of 0 (the last prompt token is always read again, so a block needs one token after it to be
    reused)."""
    out = [n for n in blocks for _ in range(BS)]
    return out + [0] * tail


def serve(pool: BlockPool, slot: int, prompt: list[int], max_tokens: int, priority: int = 0, answer: int = 0) -> int:
    """Admit, read the prompt from what is cached on, and decode `answer` tokens."""
    cached = pool.allocate(slot, prompt, max_tokens, priority)
    pool.write(slot, prompt[cached:])
    pool.write(slot, [7] * answer)
    return cached


def counters(pool: BlockPool) -> tuple[int, int, int, int, int]:
    return pool.num_free, pool.num_used, pool.num_reserved, pool.num_cached, pool.num_shared


def test_allocation_reserves_prompt_and_answer_and_freeing_returns_it():
    pool = BlockPool(num_tokens=10 * BS, block_size=BS)
    assert pool.num_blocks == 10 and pool.num_free == 10
    cached = pool.allocate(0, tokens(1, 2, tail=2), max_tokens=5, priority=0)  # 10 + 5 tokens: 4 blocks
    assert cached == 0
    assert counters(pool) == (6, 0, 4, 0, 0)
    pool.write(0, tokens(1, 2, tail=2))
    assert pool.tables[0].blocks == [0, 1, 2] and counters(pool) == (6, 3, 1, 2, 0)  # two full blocks keyed
    pool.write(0, [7, 7, 7, 7, 7])
    assert counters(pool) == (6, 4, 0, 3, 0)  # the answer filled a third
    with pytest.raises(ValueError, match="beyond the 16 tokens it reserved"):
        pool.write(0, [7, 7])  # 15 written, the 4 blocks hold 16
    assert counters(pool) == (6, 4, 0, 3, 0)  # a refused write changes nothing
    pool.free(0)
    assert counters(pool) == (10, 0, 0, 3, 0)  # the full blocks stay cached, unreferenced
    assert pool.eviction_order() == [2, 1, 0]  # last block first


def test_a_second_request_reuses_the_longest_cached_prefix_and_shares_its_blocks():
    pool = BlockPool(num_tokens=16 * BS, block_size=BS)
    serve(pool, 0, tokens(1, 2, 3), max_tokens=2)
    first = pool.tables[0].blocks
    # same first two blocks, then a different third: two blocks shared, the rest its own
    prompt = tokens(1, 2, 9)
    assert pool.blocks_needed(prompt, 2) == pool.blocks_for(len(prompt) + 2) - 2
    cached = pool.allocate(1, prompt, max_tokens=2, priority=0)
    assert cached == 2 * BS
    assert pool.tables[1].blocks == first[:2]
    assert [pool.blocks[b].ref_count for b in first[:2]] == [2, 2] and pool.num_shared == 2
    pool.write(1, prompt[cached:])
    assert pool.tables[1].blocks[2] not in first
    pool.free(0)
    assert pool.num_shared == 0 and [pool.blocks[b].ref_count for b in first[:2]] == [1, 1]
    pool.free(1)
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks


def test_a_prefix_is_found_after_its_request_ended_and_whoever_computed_it():
    pool = BlockPool(num_tokens=16 * BS, block_size=BS)
    serve(pool, 3, tokens(5, 6), max_tokens=1)
    pool.free(3)
    assert serve(pool, 0, tokens(5, 6, 7), max_tokens=1) == 2 * BS  # another slot, later
    # the prompt's last token is always read again: a cache holding the whole prompt counts one block less
    assert pool.cached_blocks(tokens(5, 6, tail=0)) == pool.tables[0].blocks[:1]
    # a different first block: the chain breaks at once, though block 6's tokens match
    assert pool.cached_blocks(tokens(9, 6, 7)) == []


def test_the_answer_is_cached_too_for_the_next_turn_of_a_conversation():
    pool = BlockPool(num_tokens=16 * BS, block_size=BS)
    prompt = tokens(1, tail=BS - 1)
    serve(pool, 0, prompt, max_tokens=2 * BS, answer=2 * BS)
    turn = list(pool.tables[0].tokens)
    pool.free(0)
    assert len(pool.cached_blocks(turn + [5])) == len(turn) // BS


def test_hashes_chain_the_whole_prefix():
    a = block_hash(None, [1, 2, 3, 4])
    assert block_hash(None, [1, 2, 3, 4]) == a
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(None, [1, 2, 3, 5]), [5, 6, 7, 8])


def test_two_reads_of_the_same_prompt_at_once_keep_one_cached_copy():
    pool = BlockPool(num_tokens=16 * BS, block_size=BS)
    prompt = tokens(1, 2)
    pool.allocate(0, prompt, 1, 0)
    pool.allocate(1, prompt, 1, 0)  # nothing cached yet: both read it
    pool.write(0, prompt)
    pool.write(1, prompt)
    assert pool.num_cached == 2  # slot 0's blocks; slot 1's copies stay private
    cached = pool.cached_blocks(tokens(1, 2, 3))
    assert cached == pool.tables[0].blocks[:2]
    pool.free(1)
    assert pool.num_cached == 2 and pool.num_free == pool.num_blocks - 3  # its copies went back empty
    pool.free(0)
    assert pool.num_free == pool.num_blocks


def test_a_read_admitted_with_nothing_cached_catches_up_on_blocks_another_read_keyed_since():
    pool = BlockPool(num_tokens=16 * BS, block_size=BS)
    first, second = tokens(1, 2, 3, tail=2), tokens(1, 2, 3, 9)
    pool.allocate(0, first, 1, 0)
    assert pool.allocate(1, second, 1, 0) == 0  # nothing cached yet
    assert pool.catch_up(1, second) == 0  # nothing keyed yet either: it would read from 0
    pool.write(0, first[: 2 * BS])
    free = pool.num_free
    assert pool.catch_up(1, second) == 2 * BS  # the two blocks slot 0 keyed, shared
    assert pool.tables[1].blocks == pool.tables[0].blocks[:2] and pool.num_shared == 2
    assert pool.tables[1].tokens == second[: 2 * BS] and pool.tables[1].num_cached_tokens == 2 * BS
    assert pool.num_free == free + 2  # no longer reserved: the blocks are slot 0's already
    assert pool.catch_up(1, second) == 0  # nothing more keyed
    pool.write(0, first[2 * BS:])
    assert pool.catch_up(1, second) == BS  # the third block, as it reads on
    pool.write(1, second[3 * BS:])
    assert pool.tables[1].blocks[:3] == pool.tables[0].blocks[:3] and pool.num_shared == 3
    pool.free(0)
    pool.free(1)
    assert pool.num_used == pool.num_reserved == 0 and pool.num_free == pool.num_blocks


def test_a_read_catches_up_only_at_a_blocks_edge_with_nothing_but_its_prompt_written():
    pool = BlockPool(num_tokens=16 * BS, block_size=BS)
    prompt = tokens(1, 2, 3)
    pool.allocate(0, prompt, 1, 0)
    pool.write(0, prompt)
    pool.allocate(1, prompt, 1, 0, use_cache=False)  # prompt scoring: sees every position itself
    assert pool.catch_up(1, prompt) == 0
    pool.allocate(2, tokens(1, 2, 3, 4), 1, 0)  # found 3 blocks; then writes half a block
    pool.write(2, [4, 4])
    assert pool.catch_up(2, tokens(1, 2, 3, 4)) == 0  # mid-block
    pool.allocate(3, tokens(5), 2 * BS, 0)
    pool.write(3, tokens(5))
    pool.write(3, [1] * (BS - 1), keyable=False)  # a decode step's entries
    assert pool.catch_up(3, tokens(5) + [1] * (BS - 1)) == 0


def test_eviction_is_least_recently_released_within_a_priority_lowest_priority_first():
    # 6 blocks; three requests of one full block + 1 token each (2 blocks), released in turn
    pool = BlockPool(num_tokens=6 * BS, block_size=BS)
    serve(pool, 0, tokens(1), max_tokens=1, priority=5)
    serve(pool, 1, tokens(2), max_tokens=1, priority=0)
    serve(pool, 2, tokens(3), max_tokens=1, priority=0)
    b1, b2, b3 = (pool.tables[s].blocks[0] for s in range(3))
    pool.free(2)
    pool.free(0)
    pool.free(1)
    assert pool.eviction_order() == [b3, b2, b1]  # priority 0 before 5; among 0, released first goes first
    # a new request needing 5 blocks takes the 3 empty ones, then evicts b3, then b2; b1 survives
    serve(pool, 0, tokens(4, 4, 4, 4), max_tokens=BS - 1, priority=0)
    assert pool.num_cached == 1 + 4 and pool.cached_blocks(tokens(1)) == [b1]
    assert pool.cached_blocks(tokens(2)) == [] and pool.cached_blocks(tokens(3)) == []


def test_a_block_keeps_the_highest_priority_of_those_that_referenced_it():
    pool = BlockPool(num_tokens=8 * BS, block_size=BS)
    serve(pool, 0, tokens(1, 2), max_tokens=1, priority=9)
    serve(pool, 1, tokens(1, 3), max_tokens=1, priority=0)  # shares block 1, later and lower
    shared, high, low = pool.tables[0].blocks[0], pool.tables[0].blocks[1], pool.tables[1].blocks[1]
    pool.free(1)
    pool.free(0)
    assert pool.blocks[shared].priority == 9
    # the shared ancestor outlives its high descendant: never orphaned
    assert pool.eviction_order() == [low, high, shared]


def test_a_prefix_reused_many_times_stays_cached_and_its_stale_entries_are_dropped():
    pool = BlockPool(num_tokens=4 * BS, block_size=BS)
    serve(pool, 0, tokens(1), max_tokens=1)
    shared = pool.tables[0].blocks[0]
    pool.free(0)
    for turn in range(3 * pool.num_blocks):  # each turn re-references the block and releases it again
        assert serve(pool, turn % 2, tokens(1), max_tokens=1) == BS
        pool.free(turn % 2)
    assert len(pool._evictable) <= 2 * pool.num_blocks  # 13 releases, compacted past 8
    assert pool.eviction_order() == [shared]  # the tails were never full: they went back empty
    serve(pool, 0, tokens(2, 3, 4), max_tokens=BS - 1)  # 4 blocks: evicts everything, the prefix last
    assert pool.cached_blocks(tokens(1)) == [] and pool.tables[0].blocks[-1] == shared


def test_a_reused_cached_block_leaves_the_free_count_a_block_a_slot_holds_does_not():
    pool = BlockPool(num_tokens=8 * BS, block_size=BS)
    serve(pool, 0, tokens(1, 2), max_tokens=1)
    prompt = tokens(1, 2, 3)
    assert pool.blocks_needed(prompt, 1) == pool.blocks_for(len(prompt) + 1) - 2  # slot 0 holds both
    pool.free(0)
    assert pool.blocks_needed(prompt, 1) == pool.blocks_for(len(prompt) + 1)  # unreferenced: they count
    free = pool.num_free
    pool.allocate(1, prompt, 1, 0)
    assert pool.num_free == free - pool.blocks_for(len(prompt) + 1)


def test_a_full_pool_refuses_to_allocate():
    pool = BlockPool(num_tokens=4 * BS, block_size=BS)
    pool.allocate(0, tokens(1, 2), max_tokens=BS - 1, priority=0)  # 3 blocks
    assert not pool.can_allocate(tokens(3), max_tokens=BS - 1)  # 2 blocks, 1 free
    with pytest.raises(ValueError, match="2 blocks needed, 1 free"):
        pool.allocate(1, tokens(3), max_tokens=BS - 1, priority=0)
    assert pool.can_allocate([1], max_tokens=BS - 1)
    with pytest.raises(ValueError, match="cannot hold one block"):
        BlockPool(num_tokens=3, block_size=4)


def grow_in_turn(pool: BlockPool, slots: list[int], blocks: int) -> None:
    """Each slot takes one block at a time, in turn (decode steps of a full batch)."""
    for n in range(1, blocks + 1):
        for slot in slots:
            pool.write(slot, [7] * BS, keyable=False)
            assert len(pool.tables[slot].blocks) == n


def test_with_placement_each_slot_grows_one_run_from_its_home_even_taking_blocks_in_turn():
    pool = BlockPool(num_tokens=16 * BS, block_size=BS, num_slots=4)  # homes 0, 4, 8, 12
    for slot in range(4):
        pool.allocate(slot, [], max_tokens=3 * BS, priority=0)
    grow_in_turn(pool, [0, 1, 2, 3], 3)
    assert [pool.tables[s].blocks for s in range(4)] == [[0, 1, 2], [4, 5, 6], [8, 9, 10], [12, 13, 14]]
    # without it the same turns interleave the slots' blocks: no slot holds a run
    plain = BlockPool(num_tokens=16 * BS, block_size=BS)
    for slot in range(4):
        plain.allocate(slot, [], max_tokens=3 * BS, priority=0)
    grow_in_turn(plain, [0, 1, 2, 3], 3)
    assert [plain.tables[s].blocks for s in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]


def test_placement_falls_back_to_the_lowest_empty_block_and_runs_on_from_there():
    pool = BlockPool(num_tokens=16 * BS, block_size=BS, num_slots=4)
    pool.allocate(0, [], max_tokens=6 * BS, priority=0)
    pool.write(0, [7] * 6 * BS, keyable=False)  # past its home's 4 blocks: into slot 1's
    assert pool.tables[0].blocks == [0, 1, 2, 3, 4, 5]
    pool.allocate(1, [], max_tokens=3 * BS, priority=0)
    pool.write(1, [7] * 3 * BS, keyable=False)  # its home (4) is taken: the lowest empty id, then on from it
    assert pool.tables[1].blocks == [6, 7, 8]
    pool.allocate(2, [], max_tokens=2 * BS, priority=0)
    pool.write(2, [7] * 2 * BS, keyable=False)  # home 8 taken, 9 is next to it and empty: the lowest empty too
    assert pool.tables[2].blocks == [9, 10]
    pool.free(0)
    pool.allocate(3, [], max_tokens=2 * BS, priority=0)
    pool.write(3, [7] * 2 * BS, keyable=False)  # its home 12 is empty
    assert pool.tables[3].blocks == [12, 13]
    pool.allocate(0, [], max_tokens=BS, priority=0)
    pool.write(0, [7] * BS, keyable=False)  # its home again, freed empty (decode steps' blocks are not keyed)
    assert pool.tables[0].blocks == [0]


def test_placement_never_evicts_out_of_order():
    pool = BlockPool(num_tokens=4 * BS, block_size=BS, num_slots=2)  # homes 0 and 2
    serve(pool, 1, tokens(5), max_tokens=0, priority=5)
    serve(pool, 0, tokens(1), max_tokens=0, priority=0)
    assert pool.tables[1].blocks == [2, 3] and pool.tables[0].blocks == [0, 1]  # each from its home
    pool.free(1)
    pool.free(0)
    assert pool.eviction_order() == [0, 2]  # the low priority's first
    pool.allocate(0, [], max_tokens=2 * BS, priority=0)
    pool.write(0, [7] * 2 * BS, keyable=False)  # its home is cached, not empty: the empty ones
    assert pool.tables[0].blocks == [1, 3]
    pool.allocate(1, [], max_tokens=BS, priority=0)
    pool.write(1, [7] * BS, keyable=False)  # nothing empty: eviction order, not its home (2)
    assert pool.tables[1].blocks == [0] and pool.eviction_order() == [2]


# -- properties ------------------------------------------------------------------------------

vocab = st.integers(0, 2)  # few token ids: prompts share prefixes often
# and prompts of whole blocks from three: they share whole blocks often, read at the same time
blocky = st.builds(lambda names, tail: [n for n in names for _ in range(BS)] + tail,
                   st.lists(st.integers(0, 2), max_size=4), st.lists(vocab, min_size=1, max_size=BS))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.one_of(st.lists(vocab, min_size=1, max_size=5 * BS), blocky),
                  st.integers(1, 2 * BS),
                  st.integers(-2, 2)),
        st.tuples(st.just("read"), st.integers(0, 5), st.sampled_from([BS, 2 * BS, 3])),
        st.tuples(st.just("step"), st.integers(0, 5), st.integers(1, BS)),
        st.tuples(st.just("end"), st.integers(0, 5)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from([0, 6]))
def test_no_block_is_leaked_refcounts_match_tables_and_the_counts_add_up(script, num_slots):
    pool = BlockPool(num_tokens=12 * BS, block_size=BS, num_slots=num_slots)  # with placement and without
    limit: dict[int, int] = {}  # slot -> tokens it may still write
    prompts: dict[int, list[int]] = {}  # slot -> its prompt, while it is read (a chunk at a time)
    prefixes: dict[bytes, list[int]] = {}  # a cached block's key -> the tokens up to its end
    for op in script:
        held = sorted(pool.tables)  # read, step and end name the op[1]-th slot that holds a request
        slot = held[op[1] % len(held)] if held and op[0] != "admit" else None
        if op[0] == "admit":
            _, prompt, max_tokens, priority = op
            slot = min(set(range(6)) - set(pool.tables), default=None)
            if slot is None or not pool.can_allocate(prompt, max_tokens):
                continue
            cached = pool.allocate(slot, prompt, max_tokens, priority)
            assert cached % BS == 0 and cached < len(prompt) and prompt[:cached] == pool.tables[slot].tokens
            prompts[slot] = prompt
            limit[slot] = max_tokens
        elif op[0] == "read" and slot in prompts:
            prompt, table = prompts[slot], pool.tables[slot]
            at = len(table.tokens)
            adopted = pool.catch_up(slot, prompt)  # what another read keyed meanwhile, then a chunk
            assert adopted % BS == 0 and table.tokens == prompt[: at + adopted]
            pool.write(slot, prompt[at + adopted : at + adopted + op[2]])
            if len(table.tokens) == len(prompt):
                del prompts[slot]
        elif op[0] == "step" and slot is not None and slot not in prompts:
            n = min(op[2], limit[slot])
            pool.write(slot, [op[2] % 3] * n)
            limit[slot] -= n
        elif op[0] == "end" and slot is not None:
            pool.free(slot)
            prompts.pop(slot, None)
        check(pool, prefixes)
    for slot in list(pool.tables):
        pool.free(slot)
    check(pool, prefixes)
    assert pool.num_used == 0 and pool.num_reserved == 0 and pool.num_free == pool.num_blocks


def check(pool: BlockPool, prefixes: dict[bytes, list[int]]) -> None:
    refs = [0] * pool.num_blocks
    for table in pool.tables.values():
        assert len(set(table.blocks)) == len(table.blocks)
        assert len(table.blocks) == pool.blocks_for(len(table.tokens))
        for b in table.blocks:
            refs[b] += 1
    assert [b.ref_count for b in pool.blocks] == refs  # never negative, never stale
    assert pool.num_free + pool.num_used + pool.num_reserved == pool.num_blocks
    assert pool.num_free >= 0 and pool.num_used == sum(1 for r in refs if r)
    assert pool.num_reserved == sum(t.num_reserved for t in pool.tables.values())
    # every cached block is reachable: its key is its own, and its prefix's blocks are cached too
    keyed = {b.hash: b.id for b in pool.blocks if b.hash is not None}
    assert len(keyed) == pool.num_cached
    for table in pool.tables.values():
        for i, b in enumerate(table.blocks):
            if pool.blocks[b].hash is not None:
                prefixes[pool.blocks[b].hash] = table.tokens[: (i + 1) * pool.block_size]
    for key, b in keyed.items():  # referenced or not: an ancestor is never evicted before it
        found = pool.cached_blocks(prefixes[key] + [0])
        assert found[-1] == b and len(found) == len(prefixes[key]) // pool.block_size


@settings(max_examples=200, deadline=None)
@given(st.lists(blocky, min_size=2, max_size=3), st.lists(st.tuples(st.integers(0, 2), st.sampled_from([BS, 2 * BS])),
                                                         max_size=40))
def test_reads_of_shared_new_prefixes_in_any_order_compute_each_block_once(prompts, turns):
    # admitted together (nothing cached), read a chunk at a time in any order, each catching up
    # before its chunk (as the worker's lines do): no full block of prompt[:-1] is ever computed
    # twice, whoever reads first
    pool = BlockPool(num_tokens=64 * BS, block_size=BS)
    for slot, prompt in enumerate(prompts):
        assert pool.allocate(slot, prompt, 1, 0) == 0
    computed: list[list[int]] = []  # the prefix each block written by a read closes
    order = [t for t in turns if t[0] < len(prompts)] + [(s, 5 * BS) for s in range(len(prompts))]
    for slot, chunk in order:
        table, prompt = pool.tables[slot], prompts[slot]
        pool.catch_up(slot, prompt)
        at = len(table.tokens)
        pool.write(slot, prompt[at : at + chunk])
        computed += [prompt[: end] for end in range(at + BS - at % BS, len(table.tokens) + 1, BS)
                     if end <= len(prompt) - 1]
    assert len(computed) == len({tuple(p) for p in computed})
    for slot, prompt in enumerate(prompts):
        full = (len(prompt) - 1) // BS
        assert all(pool.blocks[b].hash is not None for b in pool.tables[slot].blocks[:full])  # none private
