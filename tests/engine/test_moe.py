"""Mixture-of-experts layers (engine/moe.py): Qwen3-MoE and Mixtral against transformers, from an
HF folder, a float32 GGUF and a Q8_0 GGUF written here under llama.cpp's names; a quantized file's
experts kept as its blocks (engine/quants `QuantExperts`, `strata_quants::mm_experts`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from engine import hf_loader
from engine.gguf_loader import GGUFModel
from engine.layers import GatedFFN
from engine.model import Transformer
from engine.moe import Experts
from engine.quants import blocks as quants
from engine.quants.build import compiler
from engine.weights import DictSource
from tests.helpers.family_gguf import moe_gguf
from tests.helpers.quant_models import F16_AT, mix, random_blocks
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


# ---- a quantized file's experts as its blocks -------------------------------------------------

needs_kernels = pytest.mark.skipif(compiler() is None, reason="no C++ compiler: engine/quants' kernels cannot be built")


@needs_kernels
@pytest.mark.parametrize("qtype", sorted(quants.TYPES), ids=lambda q: q.name)
def test_expert_products_are_each_rows_own_product_on_its_experts_blocks(qtype):
    """`mm_experts` on random blocks of 6 experts: each (row, expert) pair's result is `mm` of that
    row alone on that expert's blocks, bit for bit (both builds, int8 and float32 activations), so
    against gguf's dequantize within `mm`'s tolerances (tests/engine/test_quants.py); an expert no
    pair chose is never read (its scales are NaN); no pairs, no rows."""
    rng = np.random.default_rng(int(qtype) + 7)
    experts_n, rows, cols = 6, 40, 512
    raw = np.stack([random_blocks(qtype, rows, cols, rng) for _ in range(experts_n)])  # [E, N, row_bytes]
    block, size = GGML_QUANT_SIZES[qtype]
    exact = torch.from_numpy(gguf_dequantize(raw.reshape(-1, raw.shape[-1]), qtype)).double().view(experts_n, rows, cols)
    poisoned = raw.copy()
    for at in F16_AT[qtype]:  # expert 5's every block scale NaN
        poisoned[5].reshape(rows, cols // block, size)[..., at:at + 2] = 0xFF
    blocks = torch.from_numpy(poisoned)
    gen = torch.Generator().manual_seed(int(qtype))
    x = torch.randn(11, cols, generator=gen)
    chosen = torch.tensor([3, 0, 3, 4, 4, 1, 3, 0, 2, 1, 3])  # not 5
    reference = torch.stack([exact[e] @ x[p].double() for p, e in enumerate(chosen.tolist())])
    for int8_x in (False, True):
        for portable in (False, True):
            y = quants.ops().mm_experts(x, blocks, chosen, int(qtype), quants.table(qtype), int8_x, portable)
            assert y.shape == (11, rows) and y.dtype == torch.float32 and torch.isfinite(y).all()
            for p, e in enumerate(chosen.tolist()):
                alone = quants.ops().mm(x[p:p + 1], blocks[e], int(qtype), quants.table(qtype), int8_x, portable)
                assert torch.equal(y[p:p + 1], alone), (int8_x, portable, p)
            error = float((y.double() - reference).norm() / reference.norm())
            assert error <= (1.5e-2 if int8_x else 1e-5), (int8_x, portable, error)
    none = quants.ops().mm_experts(x[:0], blocks, chosen[:0], int(qtype), quants.table(qtype), True, False)
    assert none.shape == (0, rows)
    with pytest.raises(RuntimeError, match="expert 6 of 6"):
        quants.ops().mm_experts(x[:1], blocks, torch.tensor([6]), int(qtype), quants.table(qtype), True, False)


def qwen3_moe_256():
    """Widths that are multiples of 256 (K-quant and IQ blocks): dim 256, experts of 256."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**(COMMON | dict(hidden_size=256)), head_dim=64, intermediate_size=256,
                         moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    return _randomized(Qwen3MoeForCausalLM(cfg))


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_K_M", "Q8_0", "IQ4_XS"])
def test_a_quantized_moe_file_keeps_its_experts_as_blocks(name, tmp_path):
    """The CPU default (bf16) on a Qwen3-MoE file in llama.cpp's mix (Q4_K_M: gate/up experts Q4_K,
    down experts Q6_K in the `more_bits` layers, Q4_K in the others): every layer's experts are the
    file's blocks in place (the same bytes, no dense copy), the model holds at most 1.15x the
    file's tensor bytes (`held_bytes`), and it reads and decodes as transformers on the file's
    own weights (int8 activations per 32, bf16 attention products: atol 0.1, as a bf16 model)."""
    hf = qwen3_moe_256()
    path = tmp_path / f"{name}.gguf"
    held = moe_gguf(path, hf, Q.F32, pick=mix(name, hf.config.num_hidden_layers))
    hf.load_state_dict(held, strict=True)  # the reference: transformers on the file's own weights
    loaded = GGUFModel(path)
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=torch.device("cpu"), int4=True)
    assert model.forms["quant-experts"] == 2 and "experts" not in model.forms
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    kinds = set()
    for i, block in enumerate(model.layers):
        for part, role in zip(block.ffn.blocks, ("gate", "up", "down")):
            stored = tensors[f"blk.{i}.ffn_{role}_exps.weight"]
            assert part.qtype == stored.tensor_type and part.raw.shape == (4, 256, stored.data.shape[-1])
            assert torch.equal(part.raw, torch.from_numpy(np.asarray(stored.data)).view(torch.uint8).view_as(part.raw))
            kinds.add(part.qtype)
        # the dense form (float32 builds, CUDA) of the same 3-D tensor: gguf's own dequantize
        exact = gguf_dequantize(np.asarray(stored.data), stored.tensor_type).reshape(4, -1, 256)
        assert torch.equal(loaded.dense(f"layers.{i}.experts_down"), torch.from_numpy(exact))
    assert kinds == {"Q4_K_M": {Q.Q4_K, Q.Q6_K}, "Q8_0": {Q.Q8_0}, "IQ4_XS": {Q.IQ4_XS}}[name]
    file_bytes = sum(int(t.n_bytes) for t in tensors.values())
    assert quants.held_bytes(model) <= 1.15 * file_bytes
    model.allocate_cache(num_slots=4, ctx=256)
    check_prefill_and_decode(hf, model, atol=0.1)
