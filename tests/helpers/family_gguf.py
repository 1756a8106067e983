"""GGUFs of the newer families as llama.cpp's converter lays them out, from a transformers model:
Qwen3-MoE and Mixtral (experts stacked), Gemma 3 (sliding layers, 1 + weight norms) and
Qwen3-Next (DeltaNet tensors in the converter's forms). Shared by the tests (the file's weights
returned, dequantized under transformers' names: the exact reference for a quantized file) and
bench/family_gguf.py (random models of real shapes for both servers: `tokenizer_of` gives the
file a tokenizer so llama-server can take text)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tests.helpers.gguf_write import common_metadata, copy_tokenizer, write_hf_as_gguf


def with_norms_and_routers_counting(hf):
    """A random transformers model whose norms (a scale of one at init) and routers (zeros) are
    jittered, so that a wrong norm or routing shows in its logits; float32, eval mode."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return hf.float().eval()


def moe_gguf(path, hf, qtype: Q, *, tokenizer_of: Path | None = None,
             pick: Callable[[str], Q] | None = None) -> dict[str, torch.Tensor]:
    cfg = hf.config
    if cfg.model_type == "mixtral":  # llama.cpp converts Mixtral as `llama` with expert tensors
        arch, experts, ffn = gguf.MODEL_ARCH.LLAMA, cfg.num_local_experts, cfg.intermediate_size
        heads: tuple[int, int] | None = (cfg.num_attention_heads, cfg.num_key_value_heads)
    else:
        arch, heads, experts, ffn = gguf.MODEL_ARCH.QWEN3MOE, None, cfg.num_experts, cfg.moe_intermediate_size

    def metadata(writer):
        common_metadata(writer, cfg, expert_ffn=ffn)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)

    return write_hf_as_gguf(path, hf, arch, metadata, qtype=qtype, heads=heads, tokenizer_of=tokenizer_of, pick=pick)


def gemma3_gguf(path, hf, qtype: Q, *, tokenizer_of: Path | None = None) -> dict[str, torch.Tensor]:
    cfg = hf.config

    def metadata(writer):
        common_metadata(writer, cfg)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in cfg.layer_types])
        writer.add_rope_freq_base_swa(float(cfg.rope_parameters["sliding_attention"]["rope_theta"]))
        writer.add_float32(gguf.Keys.Attention.SCALE.format(arch="gemma3"), cfg.query_pre_attn_scalar ** -0.5)
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)

    return write_hf_as_gguf(path, hf, gguf.MODEL_ARCH.GEMMA3, metadata, qtype=qtype, norm_plus_one=True,
                            tokenizer_of=tokenizer_of)


def qwen3next_gguf(path, hf, qtype: Q, *, legacy: bool = True,
                   tokenizer_of: Path | None = None) -> dict[str, torch.Tensor]:
    """The converter's qwen3next: gguf's own tensor names; norms stored as 1 + weight (not the
    DeltaNet's per-head norm); A_log as -exp(A_log) in `ssm_a`; the conv as [conv_dim, kernel];
    dt_bias as `ssm_dt.bias`; experts stacked; the shared expert's gate as a vector. legacy: the
    DeltaNet's input as `ssm_in` (transformers' interleaved qkvz), else `attn_qkv` + `attn_gate`.
    Matrices quantized to `qtype` (not the routers)."""
    from engine.deltanet import DeltaNetShape, deinterleave

    cfg = hf.config
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(path, "qwen3next")
    common_metadata(writer, cfg, expert_ffn=cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    attending = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"]
    interval = attending[0] + 1  # the converter's one number: every interval-th layer attends
    assert attending == list(range(interval - 1, cfg.num_hidden_layers, interval)), cfg.layer_types
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if tokenizer_of is not None:
        copy_tokenizer(gguf.GGUFReader(tokenizer_of), writer)
    shape = DeltaNetShape(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    held: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, w: torch.Tensor, quantized: bool) -> torch.Tensor:
        array = w.numpy()
        if quantized and qtype != Q.F32 and array.shape[-1] % 32 == 0:
            raw = quantize(array, qtype)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            return torch.from_numpy(dequantize(raw, qtype).reshape(array.shape).copy())
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
        return w

    for name, w in state.items():
        base = name.removesuffix(".weight")
        if base.endswith("experts.gate_up_proj"):  # [E, 2I, dim] -> ffn_gate_exps and ffn_up_exps
            prefix = names.get_name(base.replace("gate_up_proj", "gate_proj"))
            gate, up = w.chunk(2, dim=1)
            held[name] = torch.cat([add(prefix + ".weight", gate, True),
                                    add(prefix.replace("gate_exps", "up_exps") + ".weight", up, True)], dim=1)
        elif base.endswith("linear_attn.A_log"):
            add(names.get_name(base), -w.exp(), False)
            held[name] = w
        elif base.endswith("linear_attn.dt_bias"):
            held[name] = add(names.get_name(base.replace("dt_bias", "dt_proj")) + ".bias", w, False)
        elif base.endswith("linear_attn.conv1d"):
            held[name] = add(names.get_name(base) + ".weight", w[:, 0], False).unsqueeze(1)
        elif base.endswith("linear_attn.in_proj_qkvz") and not legacy:
            qkv, z, _, _ = deinterleave(w, state[name.replace("qkvz", "ba")], shape)
            prefix = names.get_name(base).rsplit(".", 1)[0]
            qkv, z = add(prefix + ".attn_qkv.weight", qkv, True), add(prefix + ".attn_gate.weight", z, True)
            held[name] = _interleave(qkv, z, shape)
        elif base.endswith("norm") and not base.endswith("linear_attn.norm"):
            held[name] = add(names.get_name(base) + ".weight", w + 1, False) - 1
        elif base.endswith("shared_expert_gate"):
            held[name] = add(names.get_name(base) + ".weight", w[0], False).unsqueeze(0)
        else:
            router = base.endswith("mlp.gate")  # stays float32, as llama-quantize leaves it
            held[name] = add(names.get_name(base) + ".weight", w, w.ndim >= 2 and not router)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _interleave(qkv: torch.Tensor, z: torch.Tensor, shape) -> torch.Tensor:
    """deinterleave's inverse for q, k, v, z: transformers' in_proj_qkvz layout."""
    dim, nk, per = qkv.shape[-1], shape.n_k_heads, shape.n_v_heads // shape.n_k_heads
    q, k, v = qkv.split((shape.key_size, shape.key_size, shape.value_size))
    return torch.cat([q.view(nk, -1, dim), k.view(nk, -1, dim), v.view(nk, per * shape.v_dim, dim),
                      z.view(nk, per * shape.v_dim, dim)], dim=1).reshape(-1, dim)
