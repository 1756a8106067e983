"""The engine's paged KV pool (engine/model.py `allocate_cache`, `assign`): a slot's positions live
in whatever pool blocks its table names, so a request may reuse blocks another request computed
and a step reads each row through its own table. On a tiny random float32 model, against the
same engine with each slot's own run of blocks (the contiguous layout)."""

from __future__ import annotations

import pytest
import torch

from engine.model import KV_BLOCK, CacheIndex
from engine.protocol import SamplingParams
from tests.helpers.tiny_engine import tiny_engine

SCORED = SamplingParams(temperature=0.0, logprobs=5)


def pooled(kv_blocks: int, num_slots: int = 3):
    engine = tiny_engine(num_slots=num_slots)
    model = engine.model
    model.allocate_cache(num_slots, engine.ctx, kv_tokens=kv_blocks * KV_BLOCK)
    return type(engine)(model, None, eos_token_ids=frozenset())


def answer(engine, slot: int, tokens: list[int], first: int, steps: int = 12):
    out, scores = [first], []
    while len(out) < steps:
        out += engine.decode([slot], [out[-1]])[0]
    scores = engine.logprobs(slot)
    return out, [(s.token, s.logprob, s.top) for s in scores]


def test_a_prompt_reusing_another_requests_prefix_blocks_gives_the_cold_run():
    header = [(5 * i + 3) % 256 for i in range(2 * KV_BLOCK)]
    first, second = header + [9, 8, 7, 6], header + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    engine = pooled(kv_blocks=8)
    assert engine.kv_tokens == 8 * KV_BLOCK and engine.room(0) == 0  # a pool smaller than 3 x ctx: nothing given
    engine.assign(0, [5, 2, 7])  # scattered, out of order
    engine.begin(0, SCORED)
    engine.read(0, first, sample=True)
    # slot 1 shares the header's two blocks (whoever computed them) and reads only what follows
    engine.assign(1, [5, 2, 0], tokens=header)
    engine.begin(1, SCORED, keep=len(header))
    warm_first = engine.read(1, second[len(header):], sample=True)
    warm = answer(engine, 1, second, warm_first)
    cold_engine = tiny_engine(num_slots=3)
    cold_engine.begin(0, SCORED)
    cold_first = cold_engine.read(0, second, sample=True)
    cold = answer(cold_engine, 0, second, cold_first)
    assert warm == cold  # tokens, their logprobs and the top 5, exactly
    n = len(second) + 11
    assert torch.equal(engine.model.slot_kv(1, n), cold_engine.model.slot_kv(0, n))
    # the shared blocks were read, not written: slot 0's prefix entries are as slot 0 wrote them
    assert torch.equal(engine.model.slot_kv(0, len(header)), engine.model.slot_kv(1, len(header)))


def test_rows_in_scattered_blocks_decode_as_each_slot_alone():
    prompts = [[(7 * s + i) % 256 for i in range(10 + 70 * s)] for s in range(3)]

    def run(engine, tables):
        out = []
        for slot, prompt in enumerate(prompts):
            if tables:
                engine.assign(slot, tables[slot])
            engine.begin(slot, SamplingParams(temperature=0.0))
            out.append([engine.read(slot, prompt, sample=True)])
        for step in range(40):  # all three, then two out of order: one gather through three tables
            active = [0, 1, 2] if step % 2 else [2, 0]
            for slot, new in zip(active, engine.decode(active, [out[s][-1] for s in active])):
                out[slot] += new
        return out

    tables = [[11, 3], [0, 9, 4], [7, 1, 10, 2]]  # 64, 192 and 256 positions, interleaved in the pool
    assert run(pooled(kv_blocks=12), tables) == run(tiny_engine(num_slots=3), None)


def test_a_write_past_the_slots_blocks_is_refused_naming_it():
    engine = pooled(kv_blocks=4)
    engine.assign(2, [1])
    engine.begin(2, SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="slot 2: writing up to position 65 beyond its 1 blocks"):
        engine.read(2, list(range(65)), sample=True)
    with pytest.raises(ValueError, match="outside the pool"):
        engine.assign(0, [4])



def test_rows_read_as_one_view_of_the_pool_give_the_gathers_logits():
    # Three slots whose blocks are runs starting equally spaced (1, 5, 9) are read as one strided
    # view of each pool; the shorter rows' view reaches into the next slot's blocks, which the mask
    # hides. The same prompts in scattered blocks are gathered: tokens, logprobs, top 5 all equal.
    # (Both are the fallback of a pool engine/attend.cpp cannot read, forced here; read in place,
    # as the CPU's default is, the runs and the scattered blocks give the same bits too.)
    prompts = [[(11 * s + 3 * i) % 256 for i in range(20 + 50 * s)] for s in range(3)]

    def run(tables, in_place=False):
        engine = pooled(kv_blocks=14)
        for block in engine.model.layers:
            assert block.mixer.in_place
            block.mixer.in_place = in_place
        model, views = engine.model, []
        step_inputs = model.step_inputs

        def spied(index):
            inputs = step_inputs(index)
            views.append(inputs.kv_view)
            return inputs
        model.step_inputs = spied
        for slot, prompt in enumerate(prompts):
            engine.assign(slot, tables[slot])
            engine.begin(slot, SCORED)
            engine.read(slot, prompt, sample=True)
        views.clear()
        for _ in range(30):
            engine.decode([0, 1, 2], [7, 8, 9])
        return [engine.logprobs(s) for s in range(3)], set(views)

    runs, views = run([[1, 2], [5, 6, 7], [9, 10, 11, 12]])
    assert views == {(1 * KV_BLOCK, 4 * KV_BLOCK)}  # every step read the view
    scattered, gathered = run([[13, 0], [8, 3, 6], [2, 11, 4, 10]])
    assert gathered == {None}
    assert [[(s.token, s.logprob, s.top) for s in row] for row in runs] == \
        [[(s.token, s.logprob, s.top) for s in row] for row in scattered]
    (in_runs, none), (in_scattered, _) = run([[1, 2], [5, 6, 7], [9, 10, 11, 12]], True), \
        run([[13, 0], [8, 3, 6], [2, 11, 4, 10]], True)
    assert none == {None}
    assert [[(s.token, s.logprob, s.top) for s in row] for row in in_runs] == \
        [[(s.token, s.logprob, s.top) for s in row] for row in in_scattered]


def test_rows_are_gathered_unless_their_runs_hold_them_equally_spaced():
    engine = pooled(kv_blocks=14)
    model = engine.model
    engine.assign(0, [1, 2])
    engine.assign(1, [5, 6, 8])  # a run of two, then a jump
    engine.assign(2, [9, 10])

    def view(slots, ends, span=192):
        return model.kv_view(CacheIndex.for_slots(slots, torch.tensor(ends).unsqueeze(1) - 1, span, ends=ends))

    assert view([0, 1], [100, 100]) == (KV_BLOCK, 4 * KV_BLOCK)
    assert view([0, 1], [100, 129]) is None  # slot 1's position 128 lies past its run
    assert view([0, 1, 2], [10, 10, 10]) == (KV_BLOCK, 4 * KV_BLOCK)  # 1, 5, 9: each row within its run
    assert view([1, 0], [10, 10]) is None  # the next row's run starts before this one's
    assert view([2], [10], span=7 * KV_BLOCK) is None  # past the pool's end (14 blocks and the spare)
    assert view([2], [10], span=6 * KV_BLOCK) == (9 * KV_BLOCK, 0)


def test_a_rows_read_places_come_from_its_table_as_every_position_would():
    """span_index (the step's read places, from whole table rows) against pool_index of each
    position 0..span-1, for scattered tables, spans off the block size, the whole context, and a
    span past the tables (its clamps)."""
    engine = pooled(kv_blocks=12)
    model = engine.model
    engine.assign(0, [7, 2, 11])
    engine.assign(1, [3])
    engine.assign(2, [0, 1, 5, 4])
    per_slot = model.tables.shape[1]
    for slots in ([0], [2, 0, 1], [1, 1]):
        rows = torch.tensor(slots)
        for span in (1, KV_BLOCK - 1, KV_BLOCK, 3 * KV_BLOCK + 5, model.ctx, per_slot * KV_BLOCK + 3):
            every = torch.arange(span).expand(len(slots), span)
            places = model.span_index(rows, span)
            assert places.is_contiguous() and torch.equal(places, model.pool_index(rows, every)), (slots, span)
