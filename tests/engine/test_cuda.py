"""The CUDA path (bf16, plain linears, quantized embedding rows on the device): run where CUDA
exists, skipped elsewhere. Compares a tiny GGUF model on the GPU with the float32 CPU reference."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.model import Transformer
from tests.engine.conftest import decode_logits, prefill_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_bf16_matches_cpu_float32(tmp_path):
    from tests.helpers.gguf_llama import tiny_llama_file

    loaded = tiny_llama_file(tmp_path, Q.Q8_0)
    logits = {}
    for device, dtype in ((torch.device("cpu"), torch.float32), (torch.device("cuda:0"), torch.bfloat16)):
        model = Transformer.build(loaded.config, loaded, dtype=dtype, device=device, int4=True)
        assert "int4" not in model.forms  # the int4 kernel here is CPU-only
        model.allocate_cache(2, 64)
        ids = list(range(3, 20))
        prefill_logits_on(model, device, 0, ids)
        prefill_logits_on(model, device, 1, ids[:9])
        logits[device.type] = decode_logits_on(model, device, [1, 0], [7, 9], [9, 17]).cpu()
    torch.testing.assert_close(logits["cuda"], logits["cpu"], atol=5e-2, rtol=0)


def prefill_logits_on(model, device, slot, ids):
    with torch.device(device):
        return prefill_logits(model, slot, ids)


def decode_logits_on(model, device, slots, tokens, positions):
    with torch.device(device):
        return decode_logits(model, slots, tokens, positions, span=64)


def test_cuda_graphs_replay_the_compiled_steps():
    """Every (rows, span) bucket recorded at start; the replayed steps give the tokens of the same
    compiled step launched kernel by kernel (steps of one, two, three rows (a padding row) and
    four, across the 256-token span)."""
    from tests.helpers.tiny_engine import packaged_run, run_four_slots, tiny_engine

    def engine(graphs: bool):
        built = tiny_engine(device="cuda:0")
        built.compile_decode(warm=True, ahead=False)
        assert built.compiled is not None and built.compiled.graphs is not None
        if not graphs:
            built.compiled.graphs = None
        return built

    with_graphs = engine(True)
    assert sorted(with_graphs.compiled.graphs.graphs) == [(r, s) for r in (1, 2, 4) for s in (256, 400)]
    assert packaged_run(with_graphs) + run_four_slots(engine(True)) == packaged_run(engine(False)) + run_four_slots(engine(False))
