"""Load a Hugging Face folder (config.json + *.safetensors) into the names `engine.model` expects."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine import rope
from engine.deltanet import DeltaNetShape, deinterleave
from engine.errors import ConfigError
from engine.model import ModelConfig

_SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3_text", "qwen3_next"}
_GEMMA = {"gemma3_text"}
# RMSNorms that scale by 1 + weight (stored here as that sum, as llama.cpp's converter does):
# Gemma 3's, and Qwen3-Next's except the DeltaNet's own per-head norm
_PLUS_ONE = {"gemma3_text", "qwen3_next"}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    # MoE (engine/moe.py): Qwen3-MoE's router and shared expert, Mixtral's router
    "mlp.gate.weight": "router",
    "block_sparse_moe.gate.weight": "router",
    "mlp.shared_expert.gate_proj.weight": "shared_gate",
    "mlp.shared_expert.up_proj.weight": "shared_up",
    "mlp.shared_expert.down_proj.weight": "shared_down",
    "mlp.shared_expert_gate.weight": "shared_router",
    "mlp.experts.down_proj": "experts_down",  # transformers 5's fused [E, dim, I]
    # Qwen3-Next's Gated DeltaNet (in_proj_qkvz and in_proj_ba are split in `load_weights`)
    "linear_attn.in_proj_qkvz.weight": "lin_qkvz",
    "linear_attn.in_proj_ba.weight": "lin_ba",
    "linear_attn.conv1d.weight": "lin_conv",
    "linear_attn.dt_bias": "lin_dt_bias",
    "linear_attn.A_log": "lin_a_log",
    "linear_attn.norm.weight": "lin_norm",
    "linear_attn.out_proj.weight": "lin_out",
}
# Gemma 3 norms the attention's and the FFN's outputs too: its post_attention_layernorm is not
# the FFN's input norm (pre_feedforward_layernorm is).
_GEMMA_NAMES = {
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# One expert's matrices (mlp.experts.{j}.gate_proj.weight, Mixtral's block_sparse_moe.experts.{j}.w1.weight):
# stacked into [E, ...] per layer.
_EXPERT_NAMES = {
    "gate_proj": "experts_gate", "up_proj": "experts_up", "down_proj": "experts_down",
    "w1": "experts_gate", "w3": "experts_up", "w2": "experts_down",
}


def _raw_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def read_config(folder: str | Path) -> ModelConfig:
    raw = _raw_config(folder)
    model_type = raw.get("model_type", "llama")
    if model_type not in _SUPPORTED:
        raise ConfigError(f"unsupported model_type {model_type!r} (supported: {sorted(_SUPPORTED)})")
    dim = raw["hidden_size"]
    n_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or dim // n_heads
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if activation not in _ACTIVATIONS:
        raise ConfigError(f"unsupported activation {activation!r} (supported: {sorted(_ACTIVATIONS)})")
    if raw.get("use_sliding_window") or raw.get("use_bidirectional_attention"):
        raise ConfigError("use_sliding_window / use_bidirectional_attention are not supported")
    extra: dict = {}
    if model_type in _GEMMA:
        extra = _gemma(raw, head_dim)
        rope_theta, rope_scaling = extra.pop("rope")
    elif model_type == "qwen3_next":
        extra = _qwen3_next(raw, head_dim)
        rope_theta, rope_scaling = extra.pop("rope")
    else:
        rope_theta, rope_scaling = rope.from_hf(raw)  # an unimplemented scaling is refused here
        if model_type in ("mistral", "mixtral") and raw.get("sliding_window"):  # every layer's window
            extra = dict(sliding_window=int(raw["sliding_window"]), sliding_layers=(True,) * raw["num_hidden_layers"])
    return ModelConfig(
        dim=dim,
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        hidden_dim=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=bool(raw.get("tie_word_embeddings", model_type in _GEMMA)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "qwen3_next") or model_type in _GEMMA,
        max_positions=raw.get("max_position_embeddings", 8192),
        n_experts_used=int(raw.get("num_experts_per_tok") or 0),
        norm_topk=model_type == "mixtral" or bool(raw.get("norm_topk_prob", True)),
        activation=_ACTIVATIONS[activation],
        **extra,
    )


def _layer_kinds(raw: dict, other: str, every: int) -> list[str]:
    """Each layer's kind: `layer_types`, else every `every`-th layer "full_attention" and the rest
    `other` (Gemma 3's sliding_window_pattern, Qwen3-Next's full_attention_interval)."""
    kinds = raw.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else other for i in range(raw["num_hidden_layers"])]
    unknown = set(kinds) - {"full_attention", other}
    if unknown:
        raise ConfigError(f"unsupported layer_types {sorted(unknown)}")
    return kinds


def _gemma(raw: dict, head_dim: int) -> dict:
    """Gemma 3's fields: sliding layers (`layer_types`, or every `sliding_window_pattern`-th layer
    global), a local RoPE base for them and the global one with its scaling (transformers 5 nests
    both under rope_parameters; 4 has rope_theta, rope_local_base_freq and rope_scaling), the
    query_pre_attn_scalar, the logits' soft-cap, embeddings scaled by sqrt(dim). Its
    attn_logit_softcapping is not applied, as transformers' and llama.cpp's Gemma 3 do not (a
    Gemma 2 field; Gemma 3's configs leave it null)."""
    kinds = _layer_kinds(raw, "sliding_attention", raw.get("sliding_window_pattern", 6))
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
        global_rope = rope.from_hf({**raw, "rope_scaling": None, "rope_parameters": full})
        local_theta = float(local.get("rope_theta", 10000.0))
        if local.get("rope_type", "default") != "default":
            raise rope.UnsupportedRope(f"RoPE scaling {local['rope_type']!r} on sliding layers is not supported")
    else:
        global_rope = rope.from_hf({"rope_theta": 1_000_000.0, **raw})
        local_theta = float(raw.get("rope_local_base_freq", 10000.0))
    return dict(
        rope=global_rope,
        sliding_window=int(raw.get("sliding_window") or 0),
        sliding_layers=tuple(kind == "sliding_attention" for kind in kinds),
        rope_local_theta=local_theta,
        attn_scale=float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
        embed_scale=float(raw["hidden_size"]) ** 0.5,
    )


def _qwen3_next(raw: dict, head_dim: int) -> dict:
    """Qwen3-Next's fields: which layers are Gated DeltaNet (`layer_types`, else every
    `full_attention_interval`-th layer attention), their shape, partial RoPE, the attention's output
    gate. Refused: dense layers between the MoE ones (llama.cpp's qwen3next has none either)."""
    kinds = _layer_kinds(raw, "linear_attention", raw.get("full_attention_interval", 4))
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1 or not raw.get("num_experts"):
        raise ConfigError("qwen3_next with dense FFN layers (mlp_only_layers, decoder_sparse_step) is not supported")
    params = {**(raw.get("rope_parameters") or {}), **({"partial_rotary_factor": raw["partial_rotary_factor"]}
                                                       if "partial_rotary_factor" in raw else {})}
    factor = float(params.pop("partial_rotary_factor", 1.0))
    cleaned = {k: v for k, v in raw.items() if k != "partial_rotary_factor"} | {"rope_parameters": params}
    return dict(
        rope=rope.from_hf(cleaned),
        linear_layers=tuple(kind == "linear_attention" for kind in kinds),
        linear=DeltaNetShape(n_k_heads=raw["linear_num_key_heads"], n_v_heads=raw["linear_num_value_heads"],
                             k_dim=raw["linear_key_head_dim"], v_dim=raw["linear_value_head_dim"],
                             kernel=raw["linear_conv_kernel_dim"]),
        rotary_dim=int(head_dim * factor),
        attn_gate=True,
    )


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """All *.safetensors tensors under engine.model's names (HF layout is already ours; one MoE
    layer's experts stacked, transformers 5's fused gate_up split; Qwen3-Next's joint q/gate
    projection and DeltaNet projections split, its A_log as -exp(A_log))."""
    model_type = _raw_config(folder).get("model_type")
    gemma = model_type in _GEMMA
    plus_one = model_type in _PLUS_ONE
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            mapped = _map_name(name, gemma)
            if plus_one and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                tensor = tensor.float() + 1  # an RMSNorm that scales by 1 + weight
            if mapped is None:
                continue
            if isinstance(mapped, tuple):
                experts.setdefault(mapped[0], {})[mapped[1]] = tensor
            elif mapped.endswith(".experts_gate_up"):
                gate, up = tensor.chunk(2, dim=1)
                out[mapped.removesuffix("_gate_up") + "_gate"], out[mapped.removesuffix("_gate_up") + "_up"] = gate, up
            else:
                out[mapped] = tensor
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ConfigError(f"{name}: experts {sorted(by_index)} are not 0..{len(by_index) - 1}")
        out[name] = torch.stack([by_index[j] for j in range(len(by_index))])
    if model_type == "qwen3_next":
        split_qwen3_next(out, read_config(folder))
    return out


def split_qwen3_next(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """In place: each attention layer's joint projection [heads x (query, gate) x head_dim, dim]
    into q and q_gate; each DeltaNet layer's interleaved qkvz and ba into lin_qkv, lin_z, lin_b,
    lin_a (engine/deltanet.py `deinterleave`), its conv [conv_dim, 1, kernel] to [conv_dim,
    kernel] and A_log to -exp(A_log). (The legacy GGUF layout is the same: engine/gguf_loader.py.)"""
    assert cfg.linear is not None
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        if cfg.is_linear(i):
            qkv, z, b, a = deinterleave(weights.pop(p + "lin_qkvz"), weights.pop(p + "lin_ba"), cfg.linear)
            weights.update({p + "lin_qkv": qkv, p + "lin_z": z, p + "lin_b": b, p + "lin_a": a})
            weights[p + "lin_conv"] = weights[p + "lin_conv"].reshape(cfg.linear.conv_dim, -1)
            weights[p + "lin_a_neg"] = -weights.pop(p + "lin_a_log").float().exp()
        else:
            joint = weights.pop(p + "q").reshape(cfg.n_heads, 2, cfg.head_dim, -1)
            weights[p + "q"], weights[p + "q_gate"] = (joint[:, j].reshape(cfg.q_size, -1) for j in (0, 1))


def _map_name(hf_name: str, gemma: bool = False) -> str | tuple[str, int] | None:
    name = hf_name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed"
    if name == "norm.weight":
        return "norm"
    if name == "lm_head.weight":
        return "output"
    if not name.startswith("layers."):
        return None  # Qwen3-Next's mtp.* (its multi-token prediction head) is not used
    _, index, rest = name.split(".", 2)
    if rest == "mlp.experts.gate_up_proj":
        return f"layers.{index}.experts_gate_up"
    parts = rest.split(".")  # mlp.experts.{j}.gate_proj.weight
    if len(parts) == 5 and parts[1] == "experts" and parts[2].isdigit() and parts[3] in _EXPERT_NAMES:
        return f"layers.{index}.{_EXPERT_NAMES[parts[3]]}", int(parts[2])
    base = (gemma and _GEMMA_NAMES.get(rest)) or _LAYER_NAMES.get(rest)
    return None if base is None else f"layers.{index}.{base}"
