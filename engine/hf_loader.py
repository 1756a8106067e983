"""Load a Hugging Face folder (config.json + *.safetensors) into the names `engine.model` expects."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine import rope
from engine.errors import ConfigError
from engine.model import ModelConfig

_SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}

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
}


def read_config(folder: str | Path) -> ModelConfig:
    raw = json.loads((Path(folder) / "config.json").read_text())
    model_type = raw.get("model_type", "llama")
    if model_type not in _SUPPORTED:
        raise ConfigError(f"unsupported model_type {model_type!r} (supported: {sorted(_SUPPORTED)})")
    rope_theta, rope_scaling = rope.from_hf(raw)  # an unimplemented scaling is refused here
    dim = raw["hidden_size"]
    n_heads = raw["num_attention_heads"]
    return ModelConfig(
        dim=dim,
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=raw.get("head_dim") or dim // n_heads,
        hidden_dim=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        max_positions=raw.get("max_position_embeddings", 8192),
    )


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """All *.safetensors tensors under engine.model's names (HF layout is already ours)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            mapped = _map_name(name)
            if mapped is not None:
                out[mapped] = tensor
    return out


def _map_name(hf_name: str) -> str | None:
    name = hf_name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed"
    if name == "norm.weight":
        return "norm"
    if name == "lm_head.weight":
        return "output"
    if not name.startswith("layers."):
        return None
    _, index, rest = name.split(".", 2)
    base = _LAYER_NAMES.get(rest)
    return None if base is None else f"layers.{index}.{base}"
