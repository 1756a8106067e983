"""The head's logits over the whole vocabulary from the file's exact rows: what a row that asks
for logprobs gets (`Transformer.exact_top`'s `scored` rows), so its normaliser, its top entries
and its chosen token are the float32 head's on the step's own residual, whichever step (eager,
compiled, ahead of time, CUDA graph) made that residual.

A low-precision head (the default's int8 rows) is exact only where `exact_top` recomputes its
candidates for the top; elsewhere each logit keeps the head's error, and its bound (`HeadBound`,
Cauchy-Schwarz) is ~10x the error seen (SmolLM2: bound 2.0 on average, error 0.06), so bounding
the normaliser through it would recompute thousands of rows a step: one pass over the rows costs
less. GGUF rows go through engine/quants' `mm` (each row unpacked once, dotted in float32 with
every residual: the file's bytes read once, no dense copy held); other rows (an HF folder's bf16,
CUDA's dense rows) a slab at a time. Either way each row's logits are computed on their own, so
they do not depend on what else shares the call."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.quants import blocks as quants
from engine.weights import RowTable

SLAB_ROWS = 8192  # vocabulary rows unpacked at a time where the C++ op does not take them


def exact_logits(rows: RowTable, h: Tensor, vocab: int) -> Tensor:
    """rows: the head's exact rows; h: [B, dim] float32 -> h . w_n for every n < vocab, [B, V]
    float32."""
    raw, qtype = getattr(rows, "blocks", None), getattr(rows, "qtype", None)
    if (raw is not None and raw.device.type == "cpu" and raw.shape[0] >= vocab and qtype in quants.TYPES
            and quants.available()):
        return quants.ops().mm(h.float(), raw[:vocab], int(qtype), quants.table(qtype))
    out = torch.empty(h.shape[0], vocab, dtype=torch.float32, device=h.device)
    hf = h.float()
    for lo in range(0, vocab, SLAB_ROWS):
        slab = rows(torch.arange(lo, min(vocab, lo + SLAB_ROWS), device=h.device))  # [n, dim] float32
        for row in range(h.shape[0]):  # one product a row: its values whatever shares the call
            out[row, lo:lo + slab.shape[0]] = torch.mv(slab, hf[row])
    return out
