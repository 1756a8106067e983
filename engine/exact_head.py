"""The head's logits over the whole vocabulary from the file's exact rows: what a row that asks
for logprobs gets (`Transformer.exact_top`'s `scored` rows), so its normaliser, its top entries
and its chosen token are the float32 head's on the step's own residual, whichever step (eager,
compiled, ahead of time, CUDA graph) made that residual.

Only a low-precision copy of an unquantized head needs this (an HF folder's bf16 head as int8
rows, CUDA's bf16): it is exact only where `exact_top` recomputes its candidates for the top;
elsewhere each logit keeps the head's error, and its bound (`HeadBound`, Cauchy-Schwarz) is ~10x
the error seen (SmolLM2: bound 2.0 on average, error 0.06), so bounding the normaliser through it
would recompute thousands of rows a step: one pass over the rows costs less. A quantized GGUF head
is exact already (the file's blocks times the float32 residual, engine/model.py) and never comes
here. The rows are taken a slab at a time, one product a row, so each row's logits do not depend
on what else shares the call."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.weights import RowTable

SLAB_ROWS = 8192  # vocabulary rows taken at a time


def exact_logits(rows: RowTable, h: Tensor, vocab: int) -> Tensor:
    """rows: the head's exact rows; h: [B, dim] float32 -> h . w_n for every n < vocab, [B, V]
    float32."""
    out = torch.empty(h.shape[0], vocab, dtype=torch.float32, device=h.device)
    hf = h.float()
    for lo in range(0, vocab, SLAB_ROWS):
        slab = rows(torch.arange(lo, min(vocab, lo + SLAB_ROWS), device=h.device))  # [n, dim] float32
        for row in range(h.shape[0]):  # one product a row: its values whatever shares the call
            out[row, lo:lo + slab.shape[0]] = torch.mv(slab, hf[row])
    return out
