"""Mixture-of-experts layers (engine/moe.py): Qwen3-MoE and Mixtral against transformers, from an
HF folder, a float32 GGUF and a Q8_0 GGUF written here under llama.cpp's names."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import hf_loader
from engine.gguf_loader import GGUFModel
from engine.layers import GatedFFN
from engine.model import Transformer
from engine.moe import Experts
from engine.weights import DictSource
from tests.helpers.family_gguf import moe_gguf
from tests.helpers.hf_reference import check_engine_greedy, check_prefill_and_decode

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)


def qwen3_moe(norm_topk: bool = True, mlp_only_layers: tuple[int, ...] = ()):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=3, norm_topk_prob=norm_topk, mlp_only_layers=list(mlp_only_layers))
    return _randomized(Qwen3MoeForCausalLM(cfg))


def mixtral(window: int | None = None):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=window)
    return _randomized(MixtralForCausalLM(cfg))


def _randomized(hf):
    with torch.no_grad():  # norms start at one and routers at zero: make them count
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("gate.weight") and p.shape[0] <= 8:  # the router
                p.normal_(0, 0.5)
    return hf.float().eval()


# ---- the layer alone ------------------------------------------------------------------------

def _experts_of(block, top_k: int, normalize: bool) -> Experts:
    """Our Experts from transformers' MoE block (its fused [E, 2I, dim] gate_up and [E, dim, I] down)."""
    return Experts(block.gate.weight.detach().float(), block.experts.gate_up_proj.detach().float(),
                   block.experts.down_proj.detach().float(), top_k, normalize)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe-unnormalized", "mixtral"])
@pytest.mark.parametrize("rows, tokens", [(1, 1), (3, 1), (1, 40)])  # decode steps and a chunk
def test_layer_matches_transformers_moe_block(family, rows, tokens):
    hf = mixtral() if family == "mixtral" else qwen3_moe(norm_topk=family == "qwen3_moe")
    block = hf.model.layers[0].mlp
    ours = _experts_of(block, hf.config.num_experts_per_tok, family != "qwen3_moe-unnormalized")
    h = torch.randn(rows, tokens, 64, generator=torch.Generator().manual_seed(rows * tokens))
    with torch.no_grad():
        ref = block(h)
    torch.testing.assert_close(ours(h), ref, atol=1e-5, rtol=0)
    # every expert a row chose is one transformers' router chose, and the compiled step's way agrees
    flat = h.reshape(-1, 64)
    weights, experts = ours.route(flat)
    _, _, hf_experts = block.gate(flat)
    assert torch.equal(experts.sort(-1).values, hf_experts.sort(-1).values)
    torch.testing.assert_close(ours._gathered(flat, weights, experts), ours._grouped(flat, weights, experts), atol=1e-5, rtol=0)


def test_shared_expert_matches_qwen3_next_moe_block():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    from engine.weights import DenseLinear

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                          num_experts_per_tok=3, norm_topk_prob=True)
    block = Qwen3NextSparseMoeBlock(cfg).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    dense = GatedFFN()
    dense.w_gate_up = DenseLinear(torch.cat([block.shared_expert.gate_proj.weight, block.shared_expert.up_proj.weight]).detach())
    dense.w_down = DenseLinear(block.shared_expert.down_proj.weight.detach())
    shared = (dense, block.shared_expert_gate.weight.detach())
    ours = Experts(block.gate.weight.detach(), block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(),
                   3, True, shared)
    h = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(h), block(h), atol=1e-5, rtol=0)


@pytest.mark.parametrize("way", ["grouped", "gathered"])
def test_silu_times_up_is_rounded_once_as_in_the_dense_ffn(way):
    # bf16 experts: with a one-hot input the gate/up products are the weights' own bf16 values,
    # and with an identity-like down the output is SiLU(gate) * up as it reached the down product:
    # computed in float32 and rounded once (a bf16 SiLU, then a bf16 product, rounds twice)
    dim, inter = 64, 32
    gen = torch.Generator().manual_seed(7)
    gate, up = torch.randn(inter, generator=gen).bfloat16(), torch.randn(inter, generator=gen).bfloat16()
    gate_up = torch.zeros(2, 2 * inter, dim, dtype=torch.bfloat16)
    gate_up[0, :, 0] = torch.cat([gate, up])
    down = torch.zeros(2, dim, inter, dtype=torch.bfloat16)
    down[0, :inter].copy_(torch.eye(inter))
    router = torch.zeros(2, dim)
    router[0, 0] = 5.0  # expert 0, weight 1 (top 1, renormalized)
    experts = Experts(router, gate_up, down, top_k=1, normalize=True)
    x = torch.zeros(1, dim, dtype=torch.bfloat16)
    x[0, 0] = 1
    weights, chosen = experts.route(x)
    out = (experts._grouped if way == "grouped" else experts._gathered)(x, weights, chosen)
    once = (torch.nn.functional.silu(gate.float()) * up.float()).bfloat16()
    assert torch.equal(out[0, :inter], once)
    twice = torch.nn.functional.silu(gate) * up
    assert not torch.equal(twice, once)  # the test can tell the two apart


def test_only_the_routed_experts_are_read():
    hf = qwen3_moe()
    ours = _experts_of(hf.model.layers[0].mlp, 3, True)
    h = torch.randn(1, 1, 64)
    _, chosen = ours.route(h[0])
    out = ours(h)
    unused = [e for e in range(8) if e not in chosen[0].tolist()]
    ours.gate_up[unused] = float("nan")  # an expert no row chose cannot change a row's output
    ours.down[unused] = float("nan")
    torch.testing.assert_close(ours(h), out, atol=0, rtol=0)
    chunk = torch.randn(1, 40, 64)  # an expert no row chose has an empty segment
    _, chosen = ours.route(chunk[0])
    assert torch.isfinite(ours(chunk)).all() == set(chosen.reshape(-1).tolist()).isdisjoint(unused)


# ---- whole models: HF folder, GGUF f32, GGUF Q8_0 -------------------------------------------

FAMILIES = {
    "qwen3_moe": lambda: qwen3_moe(norm_topk=False, mlp_only_layers=(1,)),  # a dense layer between
    "mixtral": mixtral,
    "mixtral-window": lambda: mixtral(window=12),  # every layer attends over its last 12 positions
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_folder_matches_transformers(family, tmp_path):
    hf = FAMILIES[family]()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = hf_loader.read_config(tmp_path)
    weights = hf_loader.load_weights(tmp_path)
    assert weights["layers.0.experts_gate"].shape[0] == (8 if family == "qwen3_moe" else 4)
    assert cfg.sliding_window == (12 if family == "mixtral-window" else 0)
    model = Transformer.build(cfg, DictSource(weights), dtype=torch.float32, device=torch.device("cpu"))
    assert model.forms["experts"] == (1 if family == "qwen3_moe" else 2)
    model.allocate_cache(num_slots=4, ctx=256)
    check_prefill_and_decode(hf, model)
    check_engine_greedy(hf, model)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gguf_matches_transformers(family, qtype, tmp_path):
    # llama.cpp's qwen3moe has no dense layers between and renormalizes the chosen experts' weights
    hf = qwen3_moe(norm_topk=True) if family == "qwen3_moe" else mixtral()
    path = tmp_path / f"{family}.gguf"
    held = moe_gguf(path, hf, qtype)
    loaded = GGUFModel(path)
    if qtype == Q.Q8_0:
        stored = {t.name: t.qtype for t in loaded.file.tensors.values()}
        assert stored["blk.0.ffn_gate_exps.weight"] == Q.Q8_0 and stored["blk.0.attn_q.weight"] == Q.Q8_0
        hf.load_state_dict(held, strict=True)  # the reference: transformers on the file's own weights
    model = Transformer.build(loaded.config, loaded, dtype=torch.float32, device=torch.device("cpu"))
    model.allocate_cache(num_slots=4, ctx=256)
    check_prefill_and_decode(hf, model)


def test_bf16_moe_model_stays_close(tmp_path):
    # the default dtype on the CPU: experts in bf16, routing in float32
    hf = qwen3_moe()
    path = tmp_path / "q8.gguf"
    held = moe_gguf(path, hf, Q.Q8_0)
    hf.load_state_dict(held, strict=True)
    loaded = GGUFModel(path)
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=torch.device("cpu"), int4=True)
    model.allocate_cache(num_slots=4, ctx=256)
    check_prefill_and_decode(hf, model, atol=0.1)
