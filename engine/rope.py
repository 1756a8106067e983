"""Rotary position tables as a checkpoint's config declares them: the plain kind and its scalings.

A model's config says how its rotary frequencies were stretched for a longer context than it was
pretrained on; reading past that and using the plain frequencies gives another model (Llama 3.1's
greedy answer leaves transformers' at the third token). `RopeScaling` is what the loaders read from
an HF config.json (`rope_scaling`, or transformers 5's `rope_parameters`) or from GGUF metadata
(llama.cpp's `{arch}.rope.scaling.*` keys and its `rope_freqs` tensor); `tables` makes the cos/sin
rows every layer reads. A kind not implemented here is refused at load (`UnsupportedRope`), never
run as if plain.

Kinds (the formulas are those of the YaRN paper, Meta's Llama 3.1 release and the NTK posts; the
tests check each table against transformers' own rotary modules):
- `linear`: every frequency divided by `factor` (positions interpolated).
- `dynamic` (NTK-aware): the base raised for the sequence length. transformers recomputes it per
  forward from the longest position seen, which a KV cache cannot follow (keys written earlier keep
  their rotation). Here the base is fixed once for the context the engine allocates: plain
  frequencies when that context is within `max_position_embeddings` (what transformers uses for
  every such sequence), else the frequencies transformers uses for a sequence of that length.
- `yarn`: frequencies blended between interpolated and plain along a ramp over the dimensions
  (`beta_fast`, `beta_slow`), and cos/sin scaled by the attention factor (0.1 ln(factor) + 1
  unless given).
- `llama3`: low frequencies divided by `factor`, high ones kept, a smooth blend between; a GGUF
  carries the result as per-frequency divisors (`rope_freqs`, `freq_factors` here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from engine.errors import ConfigError

KINDS = ("default", "linear", "dynamic", "yarn", "llama3")


class UnsupportedRope(ConfigError):
    """A config declares a RoPE scaling this engine does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"
    factor: float = 1.0
    original_max_positions: int = 0  # the pretraining context (llama3, yarn); 0 = not given
    max_positions: int = 0  # dynamic: the context from which the base grows
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = 0.1 ln(factor) + 1
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    freq_factors: tuple[float, ...] | None = None  # per-frequency divisors (GGUF rope_freqs), any kind

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UnsupportedRope(f"RoPE scaling {self.kind!r} is not supported (supported: {', '.join(KINDS)})")
        if self.kind in ("llama3", "yarn") and self.original_max_positions <= 0:
            raise UnsupportedRope(f"RoPE scaling {self.kind!r} needs the original context length")


def from_hf(raw: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from a config.json: `rope_scaling` (transformers 4) and/or
    `rope_parameters` (transformers 5, which holds rope_theta too)."""
    params: dict[str, Any] = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type")) or "default"
    max_positions = int(raw.get("max_position_embeddings") or 0)
    if kind not in KINDS:
        raise UnsupportedRope(f"rope_scaling {dict(params)!r}: {kind!r} is not supported (supported: {', '.join(KINDS)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0 or raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedRope("partial_rotary_factor < 1 (RoPE on part of each head) is not supported")
    if kind == "default":
        return theta, RopeScaling()
    # transformers' rule: the top-level value first (Phi-3 keeps it there), then the scaling's own,
    # then max_position_embeddings
    original = int(raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or max_positions)
    factor = params.get("factor")
    if kind == "yarn" and factor is None and original:  # DeepSeek-style: the ratio of the two contexts
        factor = max_positions / original
    if factor is None:
        raise UnsupportedRope(f"rope_scaling {kind!r} without a factor")
    if kind == "yarn" and (params.get("mscale") or params.get("mscale_all_dim")) and params.get("attention_factor") is None:
        raise UnsupportedRope("yarn with mscale/mscale_all_dim (DeepSeek's attention factor) is not supported")
    return theta, RopeScaling(
        kind=kind, factor=float(factor),
        original_max_positions=original,
        max_positions=max_positions,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        truncate=bool(params.get("truncate", True)),
    )


def from_gguf(fields: Mapping[str, Any], arch: str, freq_factors: Tensor | None) -> RopeScaling:
    """llama.cpp's metadata: `{arch}.rope.scaling.type` (none, linear, yarn, longrope), `.factor`,
    `.original_context_length`, `.yarn_beta_fast`/`.yarn_beta_slow`, `.yarn_attn_factor`; and the
    `rope_freqs` tensor its converter writes for Llama 3.1's scaling (divisors of each frequency)."""
    key = f"{arch}.rope.scaling."
    kind = str(fields.get(key + "type", "none"))
    factors = None if freq_factors is None else tuple(float(f) for f in freq_factors.reshape(-1).tolist())
    if kind == "none":
        return RopeScaling(freq_factors=factors)
    if kind not in ("linear", "yarn"):
        raise UnsupportedRope(f"GGUF RoPE scaling {kind!r} is not supported (supported: none, linear, yarn, rope_freqs)")
    factor = float(fields.get(key + "factor", 1.0))
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor, freq_factors=factors)
    if key + "yarn_log_multiplier" in fields:
        raise UnsupportedRope("yarn with yarn_log_multiplier (DeepSeek's attention factor) is not supported")
    return RopeScaling(
        kind="yarn", factor=factor, original_max_positions=int(fields.get(key + "original_context_length", 0)),
        beta_fast=float(fields.get(key + "yarn_beta_fast", 32.0)),
        beta_slow=float(fields.get(key + "yarn_beta_slow", 1.0)),
        attention_factor=yarn_mscale(factor) * float(fields.get(key + "yarn_attn_factor", 1.0)),
        freq_factors=factors,
    )


def yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling, ctx: int) -> tuple[Tensor, float]:
    """-> (inverse frequencies [head_dim/2] float64, the factor on cos/sin) for a context of `ctx`."""
    dims = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    kind, factor = scaling.kind, scaling.factor
    scale = 1.0
    if kind == "dynamic" and ctx > scaling.max_positions > 0:
        theta = theta * ((factor * ctx / scaling.max_positions) - (factor - 1)) ** (head_dim / (head_dim - 2))
    freq = 1.0 / theta**dims
    if kind == "linear":
        freq = freq / factor
    elif kind == "llama3":
        old = scaling.original_max_positions
        low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
        wavelen = 2 * math.pi / freq
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * freq / factor + smooth * freq
        freq = torch.where(wavelen > low_wavelen, freq / factor, torch.where(wavelen < high_wavelen, freq, blended))
    elif kind == "yarn":
        low, high = _yarn_range(scaling, head_dim, theta)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freq = freq / factor * ramp + freq * (1 - ramp)  # ramp 0: plain (high frequencies), 1: interpolated
        scale = scaling.attention_factor if scaling.attention_factor is not None else yarn_mscale(factor)
    if scaling.freq_factors is not None:
        if len(scaling.freq_factors) != head_dim // 2:
            raise UnsupportedRope(f"rope_freqs has {len(scaling.freq_factors)} values for a head of {head_dim}")
        freq = freq / torch.tensor(scaling.freq_factors, dtype=torch.float64)
    return freq, scale


def _yarn_range(scaling: RopeScaling, head_dim: int, theta: float) -> tuple[float, float]:
    """The dimensions between which yarn's ramp goes from plain to interpolated frequencies:
    those that turn `beta_fast` and `beta_slow` times over the original context."""
    def dim_for(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(scaling.beta_fast), dim_for(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def tables(head_dim: int, theta: float, scaling: RopeScaling, positions: int, ctx: int | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [positions, head_dim] float32 in HF's layout (the two halves of a head share
    frequencies), attention factor applied; `ctx` (default `positions`) is the context the
    frequencies are fixed for (dynamic). Angles in float64: past a few thousand positions float32
    angles lose their low bits."""
    freq, scale = inv_freq(head_dim, theta, scaling, positions if ctx is None else ctx)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), freq)
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()
