"""int4 weights straight from a GGUF's Q4_0/Q4_1 blocks (the CPU default with bf16): the blocks
are exactly the file's weights, the kernel computes what they say, and a model built on them
runs close to the dequantized float32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.model import Transformer
from engine.protocol import SamplingParams
from engine.weights import Int4Blocks, Int4Linear, can_prepack, dequantize_int4
from tests.engine.conftest import decode_logits, prefill_logits, q4_forms
from tests.helpers.gguf_llama import tiny_llama_file

GREEDY = SamplingParams(temperature=0.0)
STEPS = 16


def kernel_weight(blocks: Int4Blocks) -> torch.Tensor:
    """The weight the int4 op really uses: (q - 8) * s + z with s, z rounded to bf16."""
    q, scale, offset = blocks
    group = q.shape[1] // scale.shape[1]
    s = scale.bfloat16().float()
    z = (offset + 8 * scale).bfloat16().float()
    return (q.float() - 8) * s.repeat_interleave(group, 1) + z.repeat_interleave(group, 1)


def test_q4_0_file_blocks_are_the_dequantized_weights(tmp_path):
    # A tiny llama-arch file, every matrix Q4_0: the blocks (un-permuted like dense()) dequantize
    # to exactly the float32 weights, and the bf16 model (int4, or `mm` on AVX2 alone) decodes
    # close to the float32 one.
    loaded = tiny_llama_file(tmp_path, Q.Q4_0)
    blocks = loaded.int4_blocks()
    assert blocks is not None and len(blocks) == 2 * 7
    for name, b in blocks.items():
        assert torch.equal(dequantize_int4(b), loaded.dense(name)), name

    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = Transformer.build(loaded.config, loaded, dtype=dtype, device=torch.device("cpu"), int4=True)
        assert model.forms == ({"float32-dense": 8} if dtype == torch.float32 else q4_forms(8, prompt_copy=False)), model.forms
        model.allocate_cache(2, 64)
        ids = list(range(3, 20))
        prefill_logits(model, 0, ids)
        prefill_logits(model, 1, ids)
        logits[dtype] = decode_logits(model, [0, 1], [7, 9], [17, 17], span=64)
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], atol=3e-2, rtol=0)


def test_f16_file_has_no_int4_blocks_and_runs_bf16(tmp_path):
    loaded = tiny_llama_file(tmp_path, Q.F16)
    assert loaded.int4_blocks() is None and not loaded.is_quantized()
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=torch.device("cpu"), int4=True)
    assert model.forms == ({"bf16-packed": 8} if can_prepack() else {"bfloat16-dense": 8})


@pytest.mark.smollm2
def test_int4_linear_matches_dequantized_f32(smollm2):
    gguf = smollm2.gguf
    # The blocks are exactly the file's weights (Q/K rows un-permuted like dense()).
    for name in ("layers.0.q", "layers.0.k", "layers.0.v", "layers.7.o", "layers.29.gate", "layers.29.down"):
        assert torch.equal(dequantize_int4(gguf.int4(name)), gguf.dense(name)), name
    torch.manual_seed(0)
    for name in ("layers.0.q", "layers.29.down"):
        blocks, weight = gguf.int4(name), gguf.dense(name)
        lin = Int4Linear(blocks)
        for rows in (1, 4, 8, 16, 40):
            x = torch.randn(rows, weight.shape[1])
            y = lin(x).float()
            # Against float32 F.linear of the weights the op uses, on the bf16-rounded input: only
            # accumulation order and the bf16 rounding of the output (<= 2^-9 relative) differ.
            ref = F.linear(x.bfloat16().float(), kernel_weight(blocks))
            torch.testing.assert_close(y, ref, atol=1e-3, rtol=2**-8)
            # Against the file's exact weights in float32: bf16 input/scale/output rounding, about
            # what a dense bf16 F.linear costs (0.3 % of the output's norm here).
            exact = F.linear(x, weight)
            rel = float((y - exact).norm() / exact.norm())
            dense_bf16 = float((F.linear(x.bfloat16(), weight.bfloat16()).float() - exact).norm() / exact.norm())
            assert rel < 6e-3 and rel < 1.5 * dense_bf16, (name, rows, rel, dense_bf16)


def _greedy(engine, slot, prompt_ids, steps):
    engine.begin(slot, GREEDY)
    out = [engine.read(slot, prompt_ids, sample=True)]
    while len(out) < steps:
        out += engine.decode([slot], [out[-1]])[0]
    return out


@pytest.mark.smollm2
def test_default_engine_reads_the_q4_blocks_and_a_batch_equals_solo(smollm2, new_smollm2_engine):
    # The int4 kernel (and on AVX2 alone `mm`, tests/engine/conftest.py `q4_forms`) works row by
    # row, so a row's result does not depend on its neighbours: greedy tokens are the same alone
    # and in a batch of 3 (sliced and scattered slots). The prompts (16+ tokens) are read through
    # the bf16 copy where oneDNN packs one (AVX2 alone: float32 slabs of the blocks), every decode
    # step through the blocks.
    engine = new_smollm2_engine(torch.bfloat16, num_slots=4, ctx=256)
    assert engine.model.forms == q4_forms(120)
    tok = smollm2.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": c}])
               for c in ("Write a short poem about the sea.", "What is the capital of France?", "Name three rivers.")]
    solo = [_greedy(engine, 0, ids, STEPS) for ids in prompts]
    slots = [3, 0, 2]
    last = []
    for slot, ids in zip(slots, prompts):
        engine.begin(slot, GREEDY)
        last.append(engine.read(slot, ids, sample=True))
    batch = [[t] for t in last]
    for step in range(STEPS - 1):
        order = slots if step % 2 else sorted(slots)
        got = dict(zip(order, engine.decode(order, [batch[slots.index(s)][-1] for s in order])))
        for i, s in enumerate(slots):
            batch[i] += got[s]
    assert batch == solo
