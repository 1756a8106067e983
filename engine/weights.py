"""Weights in the form a step uses, and where they come from.

A loader hands the model a `WeightSource`: every tensor under `engine.model`'s names in HF layout,
as dense float32 on request, as the file's own 4-bit blocks where it has them (`int4`), and as a
row table for the embedding and the exact top logits (`rows`). The model then keeps exactly one
copy of each matrix, in one of the forms below, chosen at load:

- `DenseLinear`: `F.linear` on a plain weight (float32 anywhere; bf16 on CUDA).
- `PackedLinear`: bf16 reordered once into oneDNN's blocked layout (CPU).
- `Int4Linear`: the file's Q4_0/Q4_1 blocks as int4 (CPU), bf16 activations.
- `TwoFormLinear`: int4 for decode, bf16 prepacked for prefill chunks (CPU).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Int4Blocks(NamedTuple):
    """A matrix as 4-bit groups along its input dim: w[r, c] = q[r, c] * scale[r, c // g]
    + offset[r, c // g]. q: uint8 [out, in] in 0..15; scale, offset: float32 [out, in // g]."""

    q: Tensor
    scale: Tensor
    offset: Tensor


class RowTable(Protocol):
    """Rows of a [rows, dim] matrix by index, as float32 (the embedding; the head's exact logits)."""

    def __call__(self, ids: Tensor) -> Tensor: ...


class WeightSource(Protocol):
    def names(self) -> set[str]: ...

    def dense(self, name: str) -> Tensor:
        """float32, HF layout."""

    def int4(self, name: str) -> Int4Blocks | None:
        """The file's own 4-bit blocks (HF row order), or None if the tensor is not Q4_0/Q4_1."""

    def rows(self, name: str) -> RowTable: ...


class DenseRows(nn.Module):
    """Rows of a plain matrix (kept in its own dtype: an HF folder's bf16 stays bf16)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight).float()


class DictSource:
    """A WeightSource over plain tensors (HF folders, tests): no 4-bit blocks."""

    def __init__(self, weights: dict[str, Tensor]) -> None:
        self._weights = weights

    def names(self) -> set[str]:
        return set(self._weights)

    def dense(self, name: str) -> Tensor:
        return self._weights[name].float()

    def int4(self, name: str) -> Int4Blocks | None:
        return None

    def rows(self, name: str) -> RowTable:
        return DenseRows(self._weights[name])


class DenseLinear(nn.Module):
    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out]
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def can_prepack() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """bf16 weight reordered once by oneDNN (CPU): the same products as `F.linear` in bf16, bit for
    bit, but ~2x faster at 1-16 rows, where plain `F.linear` re-reads the plain layout each step."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else bias.to(torch.bfloat16)

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out] bf16
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, self.bias, "none", [], "")


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int4Linear(nn.Module):
    """`F.linear` with int4 weights via torch.ops.aten._weight_int4pack_mm_for_cpu (CPU).

    That op computes w = (q - 8) * s + z per group, so s = scale, z = offset + 8 * scale, rounded
    to bf16 (the op wants them in the activations' dtype; relative error <= 2^-9, like a bf16 copy
    of the dequantized weight). Activations go in as bf16: with float32 the op was ~50x slower
    (no vectorized kernel). Bias, if any, is added in float32 and the sum rounded to bf16."""

    def __init__(self, blocks: Int4Blocks, bias: Tensor | None = None) -> None:
        super().__init__()
        q, scale, offset = blocks
        self.out_features, in_features = q.shape
        self.group = in_features // scale.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        zero = offset.float() + 8 * scale.float()
        self.scale_zeros = torch.stack([scale.float(), zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.bias = None if bias is None else bias.float()

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out] bf16
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.packed, self.group, self.scale_zeros
        )
        if self.bias is not None:
            y = (y.float() + self.bias).to(torch.bfloat16)
        return y.view(*x.shape[:-1], self.out_features)


class TwoFormLinear(nn.Module):
    """One matrix kept twice: int4 (`Int4Linear`) for rows of few tokens, the decode step's form,
    and bf16 prepacked (`PackedLinear`, the exact weights rounded to bf16) for a prefill chunk of
    `min_tokens` or more, where the int4 kernel was 2.3x slower than oneDNN's bf16 one. Chosen by
    tokens per row (x's second-to-last dim), not by rows: a decode step has one token per row
    whatever its batch size, so a row's result never depends on how many neighbours it has."""

    def __init__(self, int4: Int4Linear, packed: PackedLinear, min_tokens: int) -> None:
        super().__init__()
        self.int4, self.packed, self.min_tokens = int4, packed, min_tokens
        self.out_features = int4.out_features

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., T, in] -> [..., T, out] bf16
        if x.dim() >= 2 and x.shape[-2] >= self.min_tokens:
            return self.packed(x)
        return self.int4(x)


def dequantize_int4(blocks: Int4Blocks) -> Tensor:
    """float32 [out, in]: q * scale + offset per group, the file's exact weights (as dense())."""
    q, scale, offset = blocks
    rows, cols = q.shape
    groups = scale.shape[1]
    w = q.view(rows, groups, cols // groups).float() * scale.unsqueeze(-1) + offset.unsqueeze(-1)
    return w.view(rows, cols)


def fuse_int4(parts: list[Int4Blocks]) -> Int4Blocks | None:
    """Stack matrices' blocks along the output dim (q/k/v, gate/up); None unless all have the
    same group size."""
    if len({p.q.shape[1] // p.scale.shape[1] for p in parts}) != 1:
        return None
    return Int4Blocks(*(torch.cat(tensors) for tensors in zip(*parts)))


def int4_shape_ok(blocks: Int4Blocks) -> bool:
    """Group sizes the CPU int4 kernel takes."""
    in_features = blocks.q.shape[1]
    group = in_features // blocks.scale.shape[1]
    return group in (32, 64, 128, 256) and in_features % group == 0
