"""Decode steps replayed from recordings (engine/graphs.py: CUDA graphs on a GPU). Here on the CPU,
a recording is the step run again into the first run's outputs, so the buckets, the padding rows,
the fixed input buffers and the wiring through `CompiledDecode` and the engine are checked
without a GPU; test_cuda.py records real CUDA graphs where CUDA exists."""

from __future__ import annotations

import torch

from engine.graphs import GraphedDecode, HeadOut, row_buckets, spans
from engine.model import CacheIndex, Transformer
from engine.runner import TorchEngine
from tests.helpers.tiny_engine import GREEDY, packaged_run, run_four_slots, tiny_engine


def test_buckets_cover_every_batch_and_span():
    assert row_buckets(1) == [1]
    assert row_buckets(2) == [1, 2]
    assert row_buckets(6) == [1, 2, 4, 6]
    assert row_buckets(8) == [1, 2, 4, 8]
    assert spans(400) == [256, 400]
    assert spans(512) == [256, 512]
    assert spans(100) == [100]


class Recorder:
    """A recording on the CPU: run once; replaying runs again and copies into those outputs."""

    def __init__(self) -> None:
        self.recorded = 0

    def __call__(self, run, pool):
        self.recorded += 1
        outputs = run()

        def replay() -> None:
            for kept, new in zip(outputs, run()):
                if kept is not None:
                    kept.copy_(new)

        return replay, outputs, pool


def _eager_step(model: Transformer):
    def step(tokens, slots, positions, span) -> HeadOut:
        index = CacheIndex(0, model.num_slots, span, slots.unsqueeze(1), positions.unsqueeze(1), sliced=False)
        h = model.forward(tokens.unsqueeze(1), index)
        return (h, *model.head_logits(h))
    return step


def _graphed(engine: TorchEngine, recorder: Recorder) -> TorchEngine:
    from engine.compiled import CompiledDecode

    compiled = CompiledDecode(engine.model)
    compiled.step = _eager_step(engine.model)  # the layers eager: nothing to compile in a test
    compiled._record_graphs(recorder)
    engine.compiled = compiled
    return engine


def _caches(engine: TorchEngine) -> list[torch.Tensor]:
    return [t.clone() for block in engine.model.layers for t in block.state()]


def test_replayed_steps_give_the_eager_tokens():
    eager = packaged_run(tiny_engine()) + run_four_slots(tiny_engine())
    recorder = Recorder()
    engine = _graphed(tiny_engine(), recorder)
    # every bucket recorded at start: rows 1, 2, 4 for each span (256 and ctx 400)
    assert recorder.recorded == 6 and sorted(engine.compiled.graphs.graphs) == [(r, s) for r in (1, 2, 4) for s in (256, 400)]
    graphed = packaged_run(engine)  # one row, three (a padding row), two; across the 256 span
    graphed += run_four_slots(_graphed(tiny_engine(), recorder))
    assert graphed == eager
    assert recorder.recorded == 12  # the steps replayed, none recorded again


def test_padding_rows_and_recording_touch_no_slot():
    engine = tiny_engine()
    model, ctx = engine.model, engine.ctx
    spare = model.spare_block * model.kv_block  # the pools' first position past every block
    for slot in range(4):
        engine.begin(slot, GREEDY)
        engine.read(slot, [(3 * slot + i) % 256 for i in range(20 + slot)], sample=True)
    before = _caches(engine)
    _graphed(engine, Recorder())
    after = _caches(engine)
    # recording ran every bucket with padding rows only: the spare block's position, nothing else
    for old, new in zip(before, after):
        assert torch.equal(old[:, :spare], new[:, :spare])
        assert not torch.equal(old[:, spare], new[:, spare])
    held = [model.slot_kv(slot, ctx) for slot in range(4)]  # [layers, 2, KV, positions, hd]
    engine.decode([1, 3, 2], [5, 6, 7])  # three rows: one padding row in the bucket of four
    assert torch.equal(held[0], model.slot_kv(0, ctx))  # slot 0 not in the step: untouched
    for slot in (1, 3, 2):  # each written at its own position only
        old, new, position = held[slot], model.slot_kv(slot, ctx), 20 + slot
        assert torch.equal(old[:, :, :, :position], new[:, :, :, :position])
        assert not torch.equal(old[:, :, :, position], new[:, :, :, position])
        assert torch.equal(old[:, :, :, position + 1:], new[:, :, :, position + 1:])


def test_a_step_reads_the_buffers_as_they_are_at_replay():
    engine = tiny_engine(num_slots=2)
    model = engine.model
    graphs = GraphedDecode(model, _eager_step(model), Recorder())
    reference = _eager_step(model)
    for slot in range(2):
        engine.begin(slot, GREEDY)
        engine.read(slot, list(range(10 + slot)), sample=True)
    with torch.inference_mode():
        first = graphs(torch.tensor([4, 9]), torch.tensor([0, 1]), torch.tensor([10, 11]), 256).clone()
        second = graphs(torch.tensor([8]), torch.tensor([1]), torch.tensor([12]), 256).clone()
        third = graphs(torch.tensor([2, 3]), torch.tensor([1, 0]), torch.tensor([13, 11]), 256).clone()
        for slot in range(2):
            engine.truncate(slot, 10 + slot)
        expected = [model.exact_top(*reference(torch.tensor(t), torch.tensor(s), torch.tensor(p), 256))
                    for t, s, p in (([4, 9], [0, 1], [10, 11]), ([8], [1], [12]), ([2, 3], [1, 0], [13, 11]))]
    for got, want in zip((first, second, third), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
