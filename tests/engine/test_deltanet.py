"""Qwen3-Next's Gated DeltaNet mixer (engine/deltanet.py) against transformers' own module."""

from __future__ import annotations

import pytest
import torch

from engine.deltanet import DeltaNetShape, deinterleave, delta_step


def _hf_layer():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                          layer_types=["linear_attention"], rms_norm_eps=1e-6)
    layer = Qwen3NextGatedDeltaNet(cfg, 0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer, DeltaNetShape(n_k_heads=2, n_v_heads=4, k_dim=16, v_dim=8, kernel=4)


@pytest.mark.parametrize("chunks", [(12,), (5, 1, 6), (1,) * 12])
def test_chunks_from_a_carried_state_match_transformers_whole_sequence(chunks):
    layer, shape = _hf_layer()
    x = torch.randn(2, sum(chunks), 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = layer(x)  # no cache: the whole sequence at once (its chunked kernel)
        qkv, z, b, a = deinterleave(layer.in_proj_qkvz.weight, layer.in_proj_ba.weight, shape)
        w_in = torch.cat([qkv, z, b, a])
        conv_w, a_neg = layer.conv1d.weight[:, 0], -layer.A_log.exp()
        conv = torch.zeros(2, shape.conv_dim, shape.kernel - 1)
        state = torch.zeros(2, shape.n_v_heads, shape.k_dim, shape.v_dim)
        outs, start = [], 0
        for n in chunks:  # a prompt read in chunks, then one token at a time: the state carries it
            out, conv, state = delta_step(x[:, start:start + n] @ w_in.T, conv_w, layer.dt_bias, a_neg, layer.norm.weight,
                                          shape, conv, state, 1e-6)
            outs.append(out @ layer.out_proj.weight.T)
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, atol=1e-4, rtol=0)


def test_deinterleave_puts_each_head_where_the_convolution_reads_it():
    # rows numbered: q of key head g is rows g*(2dk + 2 per dv) + 0..dk-1 of transformers' layout
    shape = DeltaNetShape(n_k_heads=2, n_v_heads=4, k_dim=3, v_dim=2, kernel=4)
    group = 2 * 3 + 2 * 2 * 2  # q, k, v (2 value heads of 2), z per key head
    qkvz = torch.arange(2 * group, dtype=torch.float32).unsqueeze(1)
    ba = torch.arange(8, dtype=torch.float32).unsqueeze(1)
    qkv, z, b, a = deinterleave(qkvz, ba, shape)
    assert qkv[:, 0].tolist() == [0, 1, 2, 14, 15, 16, 3, 4, 5, 17, 18, 19, 6, 7, 8, 9, 20, 21, 22, 23]
    assert z[:, 0].tolist() == [10, 11, 12, 13, 24, 25, 26, 27]
    assert b[:, 0].tolist() == [0, 1, 4, 5] and a[:, 0].tolist() == [2, 3, 6, 7]
