"""Weights in the form a step uses, and where they come from.

A loader hands the model a `WeightSource`: every tensor under `engine.model`'s names in HF layout,
as dense float32 on request, as the file's own 4-bit blocks where it has them (`int4`), and as a
row table for the embedding and the exact top logits (`rows`). The model then keeps exactly one
copy of each matrix, in one of the forms below, chosen at load:

- `DenseLinear`: `F.linear` on a plain weight (float32 anywhere; bf16 on CUDA).
- `PackedLinear`: bf16 reordered once into oneDNN's blocked layout (CPU).
- `Int4Linear`: the file's Q4_0/Q4_1 blocks as int4 (CPU), bf16 activations.
- `TwoFormLinear`: int4 (or a QuantLinear) for decode, bf16 prepacked for prefill chunks (CPU).
- `Int8Linear`: int8 per output row (CPU), bf16 activations: the vocabulary head when the file
  does not quantize it (an HF folder's, an F16 file's).
- `engine.quants.blocks.QuantLinear`: the file's Q8_0 / Q5_x / K-quant / IQ blocks as they are
  (CPU), through the C++ kernels in engine/quants/; a quantized head too (float32 activations:
  exact, no bound).

A low-precision head comes with a `HeadBound`: per-row constants that bound how far each of its
logits can be from the float32 model's, so `Transformer.logits` knows which tokens to recompute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from engine.quants.blocks import QuantBlocks


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

    def quant(self, name: str) -> "QuantBlocks | None":
        """The file's own blocks for engine.quants' kernels (engine/quants/blocks.py), or None."""


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

    def quant(self, name: str) -> None:
        return None


class DenseLinear(nn.Module):
    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out]
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def can_prepack() -> bool:
    """Whether oneDNN can reorder a bf16 weight here: not on AVX2 alone (nor under
    ONEDNN_MAX_CPU_ISA=AVX2), where it raises; the linears then stay int4 or dense."""
    if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


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
    """One matrix kept twice: the decode step's form (calling the module: `Int4Linear`, or a
    Q4_0/Q4_1 `QuantLinear`) and bf16 prepacked (`PackedLinear`, the exact weights rounded to
    bf16) for prompt tokens (`prompt_form`), where the int4 kernel was 2.3x slower than oneDNN's
    bf16 one at 256-token chunks. Chosen by what the tokens are, not by how many: every prompt
    token goes through the bf16 copy, a 1-token chunk too, and every generated token through the
    decode form, so a token's result does not depend on its chunk's length or its batch (both
    kernels work row by row)."""

    def __init__(self, decode: nn.Module, packed: PackedLinear) -> None:
        super().__init__()
        self.decode, self.packed = decode, packed
        self.prompt_form = packed
        self.out_features = packed.out_features

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out]
        return self.decode(x)


def prompt_form(linear: nn.Module) -> nn.Module:
    """The form of a linear that prompt tokens go through: its `prompt_form` where it keeps one
    (a TwoFormLinear's bf16 copy, a QuantLinear's bf16 slabs), else the linear itself."""
    return getattr(linear, "prompt_form", linear)


def in_pieces(linear: nn.Module, x: Tensor, pieces: tuple[int, ...] | None) -> Tensor:
    """The linear on x [..., T, in]: with `pieces` (a prompt read; sizes summing to T) its prompt
    form, one call per piece of rows, else (a decode step) the linear itself. A kernel whose
    blocking depends on a call's rows (oneDNN's bf16 matmul, on AMX and AVX512 alike) then gives
    a prompt token the same result whatever else its chunk held."""
    if pieces is None:
        return linear(x)
    form = prompt_form(linear)
    if len(pieces) == 1:
        return form(x)
    together = getattr(linear, "prompt_pieces", None)  # a QuantLinear: its slabs unpacked once for all pieces
    if together is not None:
        return together(x, pieces)
    return torch.cat([form(part) for part in x.split(list(pieces), dim=-2)], dim=-2)


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
    """Group sizes the CPU int4 kernel takes, and output sizes its packing takes (multiples of
    16: it raises on others, such as a small Qwen3-Next's DeltaNet input, 200 rows)."""
    out_features, in_features = blocks.q.shape
    group = in_features // blocks.scale.shape[1]
    return group in (32, 64, 128, 256) and in_features % group == 0 and out_features % 16 == 0


def int8_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int8_shape_ok(weight: Tensor) -> bool:
    """The CPU kernel steps through the input dim 16 (AVX512) or 8 (AVX2) at a time."""
    return weight.shape[1] % 16 == 0


class Int8Linear(nn.Module):
    """`F.linear` with int8 weights, one scale per output row, via
    torch.ops.aten._weight_int8pack_mm (CPU): half the bytes of bf16, the same bf16 activations.

    The kernel multiplies each int8 weight by its row's scale in float32 (exact: a 7-bit integer
    times a bf16 scale fits float32's mantissa), accumulates in float32 and rounds the result to
    bf16. The scale is a bf16 number (the kernel takes it in the activations' dtype) chosen at
    least max|w| / 127, so no weight is clipped; `dequantized` is exactly the matrix it multiplies."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        weight = weight.float()
        self.out_features = weight.shape[0]
        self.scale = _bf16_at_least(weight.abs().amax(dim=1).clamp_min(1e-30) / 127)
        self.q = torch.round(weight / self.scale.float().unsqueeze(1)).clamp_(-127, 127).to(torch.int8)

    def dequantized(self, rows: slice = slice(None)) -> Tensor:
        """float32 rows of the matrix the kernel multiplies."""
        return self.q[rows].float() * self.scale[rows].float().unsqueeze(1)

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out] bf16
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.q, self.scale)
        return y.view(*x.shape[:-1], self.out_features)


def _bf16_at_least(values: Tensor) -> Tensor:
    """float32 -> the smallest bf16 numbers >= each value (positive values)."""
    rounded = values.to(torch.bfloat16)
    return torch.where(rounded.float() < values, (rounded.view(torch.int16) + 1).view(torch.bfloat16), rounded)


class HeadBound:
    """A bound on |h . w_n - head(h)_n| for every row n of a low-precision head, cheap per step.

    The head computes c_n = bf16( sum_k x_k W_nk ) with x = bf16(h), W its own (quantized or
    bf16) copy of the exact rows w, accumulated in float32. Then
        h.w_n - x.W_n = (h - x).w_n + x.(w_n - W_n) + (float32 accumulation error),
    so by Cauchy-Schwarz
        |h.w_n - sum| <= |x| e_n + (|h - x| + g |x|) (|w_n| + e_n),   e_n = |w_n - W_n|,
    with g = K 2^-24 (K float32 additions, each rounding by at most 2^-24 relative, of terms whose
    absolute sum is at most |x| |W_n| <= |x| (|w_n| + e_n)), and rounding the sum to bf16 moves it
    by at most 2^-8 |c_n|. `table` holds [e_n; |w_n| + e_n] and `coefficients` gives
    [|x|; |h - x| + g |x|] per row, so the first two terms for all rows are one small matmul.
    Norms are taken in float32 and padded by 2^-10 relative, far above their own rounding."""

    ROUNDING = 2.0**-8 * (1 + 2.0**-6)  # bf16 output rounding, with slack for float32 arithmetic
    PAD = 1 + 2.0**-10

    def __init__(self, exact: Tensor, effective: Callable[[slice], Tensor], *, reduced_sums: int = 0,
                 chunk: int = 4096) -> None:
        """exact: float32 [V, K] rows; effective(rows): those rows of the matrix the head multiplies,
        as float32 (taken a chunk at a time, so no second full-size copy exists). reduced_sums:
        partial sums the head's matmul may round to bf16 before adding them (cuBLAS's split-K
        reduction in bf16 on CUDA), each adding up to 2^-8 |x| |W_n|."""
        errors, norms = [], []
        for lo in range(0, exact.shape[0], chunk):
            rows = slice(lo, lo + chunk)
            w = exact[rows].float()
            errors.append(torch.linalg.vector_norm(w - effective(rows), dim=1))
            norms.append(torch.linalg.vector_norm(w, dim=1))
        error, norm = torch.cat(errors), torch.cat(norms)
        self.table = (torch.stack([error, norm + error]) * self.PAD).contiguous()  # [2, V] float32
        self.accumulation = exact.shape[1] * 2.0**-24 + reduced_sums * 2.0**-8

    def to(self, device: torch.device) -> "HeadBound":
        self.table = self.table.to(device)
        return self

    def coefficients(self, h: Tensor, x: Tensor) -> Tensor:
        """h: [B, K] float32, x: [B, K] what the head was given (bf16) -> [B, 2] float32."""
        xf = x.float()
        norms = torch.linalg.vector_norm(torch.stack([xf, h - xf]), dim=-1)  # [2, B]
        norms[1] += self.accumulation * norms[0]
        return (norms * self.PAD).t()
