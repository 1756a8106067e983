"""Quantized matrices as the file's own blocks, multiplied by the C++ kernels in this folder.

A `QuantBlocks` is a matrix's raw GGUF rows (uint8 [out, row_bytes]: every row whole blocks,
rows already in HF order) and its type. `QuantLinear` multiplies by it: a decode step (few tokens
a row) through `strata_quants::mm`, which unpacks one row of blocks at a time into a cache-sized
buffer, bit for bit gguf's values, and dots it in float32 with every activation row; a prefill
chunk (`PREFILL_MIN_TOKENS` or more a row) a slab of rows at a time, unpacked to float32, rounded
to bf16 and multiplied by oneDNN (`F.linear` in bf16, the default's prefill arithmetic), so no
dense copy is ever held. `QuantRows` looks rows up (the embedding, the head's exact top logits).
Either holds exactly the file's bytes for the matrix."""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from torch import Tensor, nn

from engine.quants.build import load

# What the kernels take (dequant.cpp). Q4_0/Q4_1 stay on torch's int4 path when it applies.
TYPES = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_S}
INT4_TYPES = {Q.Q4_0, Q.Q4_1}  # torch's int4 kernel takes these first (model.py), unless --no-int4
# Heads kept on the int8-per-row path (the default model's tied Q8_0 embedding): the kernels
# take every other type in TYPES, exactly.
INT8_HEAD_TYPES = {Q.Q8_0, Q.Q4_0, Q.Q4_1}
# Tokens per row from which a product goes through bf16 slabs (as the int4 matrices' bf16 copy).
PREFILL_MIN_TOKENS = 16
SLAB_BYTES = 8 << 20  # float32 bytes of one unpacked slab of rows in a prefill product


class QuantBlocks(NamedTuple):
    raw: Tensor  # uint8 [rows, row_bytes]
    qtype: Q
    cols: int


def available() -> bool:
    """The kernels are built and loaded (a C++ compiler was there)."""
    return load() is None


def ops():  # noqa: ANN201 (torch's op namespace)
    """torch.ops.strata_quants, loaded."""
    if load() is not None:
        raise RuntimeError(f"strata_quants kernels unavailable: {load()}")
    return torch.ops.strata_quants


@cache
def table(qtype: Q) -> Tensor:
    """The codebook a type's kernel looks values up in, taken from gguf-py's own quants module."""
    from gguf import quants

    if qtype == Q.IQ4_XS:
        return torch.tensor(quants.IQ4_NL.kvalues, dtype=torch.float32)
    if qtype == Q.IQ3_S:
        quants.IQ3_S.init_grid()
        return torch.from_numpy(np.ascontiguousarray(quants.IQ3_S.grid, dtype=np.float32).reshape(-1))
    return torch.empty(0)


def row_bytes(qtype: Q, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return cols // block * size


def dequantize(blocks: QuantBlocks) -> Tensor:
    """float32 [rows, cols], bit for bit gguf.quants.dequantize of the same bytes."""
    return ops().dequantize(blocks.raw, int(blocks.qtype), blocks.cols, table(blocks.qtype))


def shape_ok(qtype: Q, cols: int) -> bool:
    block = GGML_QUANT_SIZES[qtype][0]
    return qtype in TYPES and cols % block == 0


class QuantLinear(nn.Module):
    """`F.linear` by matrices kept as GGUF blocks, stacked along the output dim (q/k/v and
    gate/up may be of different types in a K-quant mix: Q4_K_M stores v as Q6_K). float32 out."""

    def __init__(self, parts: list[QuantBlocks], bias: Tensor | None = None, *, slabs: bool = True) -> None:
        """slabs: a call of PREFILL_MIN_TOKENS or more tokens a row goes through bf16 slabs (not
        for the head, whose rows are a batch's rows, one token each)."""
        super().__init__()
        self.parts, self.slabs = parts, slabs
        self.cols = parts[0].cols
        assert all(p.cols == self.cols for p in parts)
        self.out_features = sum(p.raw.shape[0] for p in parts)
        self.bias = None if bias is None else bias.float()

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out] float32
        flat = x.reshape(-1, x.shape[-1])
        prefill = self.slabs and x.dim() >= 3 and x.shape[-2] >= PREFILL_MIN_TOKENS
        outs = [self._slabs(flat, p) if prefill else ops().mm(flat, p.raw, int(p.qtype), table(p.qtype))
                for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _slabs(self, x: Tensor, part: QuantBlocks) -> Tensor:
        """Many tokens: a slab of rows unpacked, rounded to bf16, multiplied by oneDNN."""
        xb = x.to(torch.bfloat16)
        step = max(1, SLAB_BYTES // (4 * self.cols))
        rows = part.raw.shape[0]
        out = torch.empty(x.shape[0], rows, dtype=torch.float32)
        for lo in range(0, rows, step):
            slab = QuantBlocks(part.raw[lo:lo + step], part.qtype, part.cols)
            out[:, lo:lo + step] = F.linear(xb, dequantize(slab).to(torch.bfloat16))
        return out

    def dequantized(self, rows: slice = slice(None)) -> Tensor:
        """float32 rows of the matrix (the exact file weights; a one-part matrix, the head)."""
        (part,) = self.parts
        return dequantize(QuantBlocks(part.raw[rows], part.qtype, part.cols))


class QuantRows(nn.Module):
    """Rows of a quantized matrix kept as its blocks, unpacked on lookup (the embedding; the
    head's exact rows): the file's bytes, the file's exact values."""

    def __init__(self, blocks: QuantBlocks) -> None:
        super().__init__()
        self.qtype, self.dim = blocks.qtype, blocks.cols
        self.register_buffer("blocks", blocks.raw, persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [...] long -> [..., dim] float32
        rows = QuantBlocks(self.blocks[ids.reshape(-1)], self.qtype, self.dim)
        return dequantize(rows).reshape(*ids.shape, self.dim)


def held_bytes(module: nn.Module) -> int:
    """Bytes of the distinct tensors a model keeps for its weights (every tensor attribute,
    buffer and parameter of its modules, QuantLinear's parts, a HeadBound's table; KV caches and
    RoPE tables left out), each storage counted once."""
    seen: dict[int, int] = {}

    def add(t: object) -> None:
        if isinstance(t, Tensor) and t.numel():
            if t.layout == torch.strided and not t.is_mkldnn:
                s = t.untyped_storage()
                seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
            else:  # oneDNN's reordered weights: no storage to share
                seen[id(t)] = t.numel() * t.element_size()
        elif isinstance(t, QuantBlocks):
            add(t.raw)
        elif isinstance(t, (list, tuple)):
            for item in t:
                add(item)

    for part in module.modules():
        for name, value in vars(part).items():
            if name in ("k_cache", "v_cache", "cos", "sin"):
                continue
            if name in ("_parameters", "_buffers"):
                for t in value.values():
                    add(t)
            elif hasattr(value, "table") and isinstance(getattr(value, "table"), Tensor):  # HeadBound
                add(value.table)
            else:
                add(value)
    return sum(seen.values())
