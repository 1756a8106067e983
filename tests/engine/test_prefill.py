"""Prompt reading (prefill chunks): the fused attention a chunk uses computes what the plain
float32 path computes."""

from __future__ import annotations

import pytest
import torch

from engine.layers import attend_plain, attend_prompt
from engine.model import CacheIndex
from engine.weights import can_prepack

# The bf16 prompt copy is a oneDNN-prepacked matrix; on AVX2 alone oneDNN cannot pack bf16, so
# the model keeps int4 only and reads prompts with the int4 kernel (test_int4 covers that form).
needs_prepack = pytest.mark.skipif(not can_prepack(), reason="oneDNN cannot prepack bf16 on this CPU (AVX2 alone)")


def test_chunk_attention_matches_the_plain_float32_path():
    # 40 queries at positions 100..139 of a slot whose cache holds 300 entries (those past 139
    # are stale and must stay hidden), 9 query heads over 3 kv heads, bf16 q/k/v as the model
    # makes them (the float32 cache holds bf16 values).
    torch.manual_seed(0)
    heads, kv, hd, seq, start = 9, 3, 64, 40, 100
    q = (torch.randn(1, heads, seq, hd) * 3).bfloat16()
    keys = (torch.randn(2, kv, 300, hd) * 3).bfloat16().float()
    values = torch.randn(2, kv, 300, hd).bfloat16().float()
    index = CacheIndex.for_slots([1], torch.arange(start, start + seq).unsqueeze(0), span=300)
    k, v = keys[1:2], values[1:2]
    fused = attend_prompt(q, k, v, index.mask())
    plain = attend_plain(q, k, v, index.mask())
    assert fused.shape == plain.shape == (1, seq, heads * hd) and fused.dtype == torch.bfloat16
    # float64 reference with only the visible keys: query at position p sees keys 0..p.
    ref = torch.empty(seq, heads, hd, dtype=torch.float64)
    for t in range(seq):
        p = start + t
        for h in range(heads):
            kk, vv = k[0, h // 3, : p + 1].double(), v[0, h // 3, : p + 1].double()
            w = torch.softmax(kk @ q[0, h, t].double() / hd**0.5, dim=0)
            ref[t, h] = w @ vv
    ref = ref.reshape(1, seq, heads * hd)
    for out in (fused, plain):  # each within the bf16 rounding of its output
        torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=2**-8)
    torch.testing.assert_close(fused.float(), plain.float(), atol=1e-3, rtol=2**-7)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a module holds (the linears keep theirs as plain attributes)."""
    return [v for m in module.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]


@needs_prepack
def test_two_form_linear_prompt_tokens_take_the_bf16_copy_generated_ones_int4(tmp_path):
    # A tiny Q4_0 file: the module itself (a decode step's form) is int4 whatever the batch and
    # tokens per row, its prompt_form the bf16 prepacked copy of the exact weights, each bit for
    # bit what its own form computes, and both close to float32 on the file's exact weights.
    from gguf import GGMLQuantizationType as Q

    from engine.weights import Int4Linear, PackedLinear, TwoFormLinear, dequantize_int4, prompt_form
    from tests.helpers.gguf_llama import tiny_llama_file

    loaded = tiny_llama_file(tmp_path, Q.Q4_0)
    blocks, exact = loaded.int4("layers.1.down"), loaded.dense("layers.1.down")
    assert torch.equal(dequantize_int4(blocks), exact)
    int4, packed = Int4Linear(blocks), PackedLinear(exact.bfloat16())
    both = TwoFormLinear(int4, packed)
    assert prompt_form(both) is both.packed and prompt_form(int4) is int4 and prompt_form(packed) is packed
    torch.manual_seed(0)
    for rows, tokens in ((1, 1), (16, 1), (40, 1), (1, 15), (1, 16), (1, 40)):
        x = torch.randn(rows, tokens, exact.shape[1])
        ref = torch.nn.functional.linear(x, exact)
        for y, form in ((both(x), int4), (prompt_form(both)(x), packed)):
            assert y.shape == (rows, tokens, exact.shape[0]) and y.dtype == torch.bfloat16
            assert torch.equal(y, form(x)), (rows, tokens)
            assert float((y.float() - ref).norm() / ref.norm()) < 6e-3, (rows, tokens)
    # Memory: the int4 nibbles and one bf16 copy, no float32 matrix.
    held = _tensors(both)
    assert {(t.dtype, tuple(t.shape)) for t in held if t.numel() >= exact.numel() // 2} == {
        (torch.uint8, (exact.shape[0], exact.shape[1] // 2)), (torch.bfloat16, tuple(exact.shape))}
    assert not any(t.dtype == torch.float32 and t.dim() == 2 for t in held)


@needs_prepack
def test_prompt_reads_of_any_length_use_the_bf16_copy_and_decode_the_decode_form(tmp_path):
    # A model with both forms reads a prompt, a long chunk or a 1-token one, exactly as the
    # all-bf16 model does, and decodes exactly as the int4-only model does. Where the blocks' bf16
    # tile reads Q4_0 prompts (engine/quants/blocks.py `bf16_prompt_here`) no copy is made: it
    # then reads them as the model without the copy, as close to float32.
    from gguf import GGMLQuantizationType as Q

    from engine.model import Transformer
    from tests.engine.conftest import decode_logits, prefill_logits, q4_forms
    from tests.helpers.gguf_llama import tiny_llama_file

    loaded = tiny_llama_file(tmp_path, Q.Q4_0)
    cpu = torch.device("cpu")
    models = {}
    for name, kwargs in (("both", {"int4": True, "prefill_bf16": True}), ("int4", {"int4": True}),
                         ("bf16", {"int4": False}), ("f32", {})):
        dtype = torch.float32 if name == "f32" else torch.bfloat16
        models[name] = Transformer.build(loaded.config, loaded, dtype=dtype, device=cpu, **kwargs)
        models[name].allocate_cache(2, 128)
    assert models["both"].forms == q4_forms(8) and models["int4"].forms == q4_forms(8, prompt_copy=False)
    copied = q4_forms(8) != q4_forms(8, prompt_copy=False)
    for ids in (list(range(3, 39)), [40], list(range(40, 48))):
        got = {name: prefill_logits(m, 0, ids) for name, m in models.items()}
        assert torch.equal(got["both"], got["bf16" if copied else "int4"]), len(ids)
        torch.testing.assert_close(got["both"], got["f32"], atol=3e-2, rtol=0)
    # Decode: the decode form (engine/quants' dots, or torch's int4 kernel). Given the same cache
    # entries, "both" steps as the model without the copy.
    for mine, theirs in zip(models["both"].layers, models["int4"].layers):
        theirs.mixer.k_cache.copy_(mine.mixer.k_cache)
        theirs.mixer.v_cache.copy_(mine.mixer.v_cache)
    decoded = {name: decode_logits(models[name], [0], [7], [len(ids)], span=128) for name in ("both", "int4")}
    assert torch.equal(decoded["both"], decoded["int4"])
