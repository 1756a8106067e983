"""What the KV pool stores per entry (`--kv-dtype`): float32, float16, bfloat16, int8, or fp8 (CUDA only).

Attention computes in float32 whatever the pool holds: a layer writes its new K/V with `store`;
a decode step on the CPU reads the entries where they lie, widening each as it reads it
(engine/attend.cpp, the same values as `load`), and a prompt read or CUDA turns the rows it
gathered back with `load` (engine/layers.py `Attention.forward`): a narrower entry costs a
conversion as it is read, never a second pass over the pool.

int8 and fp8 entries are scaled per token and head: the 64 values of a head's K (or V) at one
position share one float32 scale, absmax / 127 (int8) or absmax / 448 (fp8 e4m3), kept in the
entry's last 4 bytes, so an entry is `head_dim + 4` elements of the pool's dtype and the pool
stays one buffer per K and V (the layers' state, the compiled steps' inputs, unchanged): 68 bytes
a head for SmolLM2's head_dim 64 against 256 in float32. A per-token scale follows each token's
own range (llama.cpp's q8_0 scales blocks of 32 values likewise), so no calibration is needed.

float16 is the CPU default under bf16 activations (llama.cpp's own default cache): half float32's
bytes, and with its 11 significant bits the default file's teacher-forced KL to float32 stays the
float32 pool's where bfloat16's 8 more than doubled it; it flips a near-tie now and then (2 of
bench.precision's 576 tokens, docs/kv_pool.md). Its range ends at 65 504, so a value
past it is stored as 65 504 rather than as infinity (which would make every score of the head
infinite): a K or V that large would be far outside any trained model's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.errors import ConfigError

CHOICES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8")
SCALE_BYTES = 4  # a float32 scale per (token, head) in a scaled entry's last bytes
_NAMED = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "fp8": torch.float8_e4m3fn}
_HALF_MAX = torch.finfo(torch.float16).max  # 65 504: past it float16 has only infinity
_LIMIT = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest stored magnitude


def resolve(name: str | None, device: torch.device, activations: torch.dtype) -> torch.dtype:
    """The pool's dtype for `--kv-dtype NAME`. auto (None): on the CPU float16 under bf16
    activations (attention reads it in place, converting each entry as it goes: half the bytes,
    the same tokens; docs/kv_pool.md) and float32 on the float32 path, the exact one; on CUDA the
    activations' dtype."""
    if name in (None, "auto"):
        if device.type != "cpu":
            return activations
        return torch.float32 if activations == torch.float32 else torch.float16
    if name not in _NAMED:
        raise ConfigError(f"unsupported --kv-dtype {name!r} (use one of {', '.join(CHOICES)})")
    if name == "fp8" and device.type != "cuda":
        raise ConfigError(f"--kv-dtype fp8 needs a CUDA device (this worker's is {device.type}): "
                          "use int8 for a quantized cache on the CPU")
    return _NAMED[name]


def is_scaled(dtype: torch.dtype) -> bool:
    return dtype in _LIMIT


def entry_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one stored (token, head) entry: the head's values, then a scaled dtype's scale."""
    return head_dim + SCALE_BYTES if is_scaled(dtype) else head_dim


def entry_bytes(head_dim: int, dtype: torch.dtype) -> int:
    return entry_width(head_dim, dtype) * dtype.itemsize


def store(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x [..., head_dim] float32 -> [..., entry_width] of `dtype`: what the pool keeps for it."""
    if dtype == torch.float16:
        return x.clamp(-_HALF_MAX, _HALF_MAX).to(dtype)
    if not is_scaled(dtype):
        return x.to(dtype)
    limit = _LIMIT[dtype]
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / limit
    q = (x / scale)
    q = q.round().clamp(-limit, limit) if dtype == torch.int8 else q.clamp(-limit, limit)
    return torch.cat([q.to(dtype), scale.view(dtype)], dim=-1)


def load(rows: Tensor, head_dim: int) -> Tensor:
    """rows [..., entry_width] as the pool keeps them -> [..., head_dim] float32."""
    if not is_scaled(rows.dtype):
        return rows.float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return rows[..., :head_dim].float() * scale
