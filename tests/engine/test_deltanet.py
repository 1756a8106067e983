"""Qwen3-Next's Gated DeltaNet mixer (engine/deltanet.py) against transformers' own module."""

from __future__ import annotations

import pytest
import torch

from engine.deltanet import DeltaNetShape, DeltaNetWeights, delta_step


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
    shape = DeltaNetShape(n_k_heads=2, n_v_heads=4, k_dim=16, v_dim=8, kernel=4)
    weights = DeltaNetWeights(qkvz=layer.in_proj_qkvz.weight.detach(), ba=layer.in_proj_ba.weight.detach(),
                              conv=layer.conv1d.weight.detach()[:, 0], dt_bias=layer.dt_bias.detach(),
                              a_log=layer.A_log.detach(), norm=layer.norm.weight.detach(), out=layer.out_proj.weight.detach())
    return layer, shape, weights


@pytest.mark.parametrize("chunks", [(12,), (5, 1, 6), (1,) * 12])
def test_chunks_from_a_carried_state_match_transformers_whole_sequence(chunks):
    layer, shape, weights = _hf_layer()
    x = torch.randn(2, sum(chunks), 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = layer(x)  # no cache: the whole sequence at once (its chunked kernel)
    conv = torch.zeros(2, shape.conv_dim, shape.kernel - 1)
    state = torch.zeros(2, shape.n_v_heads, shape.k_dim, shape.v_dim)
    outs, start = [], 0
    for n in chunks:  # a prompt read in chunks, then one token at a time: the state carries it
        out, conv, state = delta_step(x[:, start:start + n], weights, shape, conv, state, 1e-6)
        outs.append(out)
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, atol=1e-4, rtol=0)
