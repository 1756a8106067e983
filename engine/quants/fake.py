"""What `strata_quants::mm`, `::mm_experts`, `::dequantize` (ops.cpp) and `strata_attend::decode`
(engine/attend.cpp) return, without running them: the fake
(meta) kernels dynamo, inductor and torch.export trace the decode step's products with, so the
file's blocks go into compiled graphs and packages compiled ahead of time as graph inputs, and
the C++ op is called from there (a fallback kernel: inductor does not look inside it)."""

from __future__ import annotations

import torch
from torch import Tensor


def register(library: str) -> None:
    """Once a library is loaded (build.load): its ops get their fake kernels."""
    if library == "strata_attend":
        torch.library.register_fake("strata_attend::decode", _decode)
        return
    torch.library.register_fake("strata_quants::mm", _mm)
    torch.library.register_fake("strata_quants::mm_experts", _mm_experts)
    torch.library.register_fake("strata_quants::dequantize", _dequantize)


def _decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, read_at: Tensor, mask: Tensor, scale: float) -> Tensor:
    # q: [B, T, H, D], pools [KV, N, W], read_at [B, L], mask [B, T, L] -> [B, T, H * D] float32
    torch._check(q.dim() == 4 and k_pool.dim() == 3)
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2] * q.shape[3]), dtype=torch.float32)


def _mm(x: Tensor, blocks: Tensor, qtype: int, table: Tensor, int8_x: bool = False, portable: bool = False) -> Tensor:
    # x: [M, K] any float, blocks: uint8 [N, row_bytes] -> [M, N] float32
    torch._check(x.dim() == 2 and blocks.dim() == 2)
    return x.new_empty((x.shape[0], blocks.shape[0]), dtype=torch.float32)


def _mm_experts(x: Tensor, blocks: Tensor, experts: Tensor, qtype: int, table: Tensor, int8_x: bool = False,
                portable: bool = False) -> Tensor:
    # x: [P, K], blocks: uint8 [E, N, row_bytes], experts: [P] -> [P, N] float32
    torch._check(x.dim() == 2 and blocks.dim() == 3 and experts.dim() == 1)
    return x.new_empty((x.shape[0], blocks.shape[1]), dtype=torch.float32)


def _dequantize(blocks: Tensor, qtype: int, cols: int, table: Tensor, portable: bool = False,
                bf16: bool = False) -> Tensor:
    # blocks: uint8 [rows, row_bytes] -> [rows, cols] float32 (bf16 with bf16)
    return blocks.new_empty((blocks.shape[0], cols), dtype=torch.bfloat16 if bf16 else torch.float32)
