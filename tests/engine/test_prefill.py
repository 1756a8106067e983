"""Prompt reading (prefill chunks): the fused attention a chunk uses computes what the plain
float32 path computes."""

from __future__ import annotations

import torch

from engine.model import CacheIndex, attend, attend_plain


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
    fused = attend(q, k, v, index.mask())
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
