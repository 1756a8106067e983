"""The decode step's layers under torch.compile: fewer, fused kernels per token.

At batch 1 an eager step is mostly Python and kernel launches (~300 small ops for SmolLM2's 30
layers); a compiled layer fuses the norms, RoPE, softmax and residual adds around the matmuls.

Regional: one layer is compiled, not the 30-layer model. Every layer has the same code and its
weights and K/V buffers go in as the graph's inputs, so dynamo traces once and inductor builds one
set of kernels that all layers run: the compile takes a layer's time, not the model's. Two graphs
cover every batch: one for a single row (sizes of 1 are always specialized) and one for 2+ rows
whose batch size and attention span are dynamic, so neither a new batch size nor a longer context
compiles again. The embedding lookup, RoPE tables, mask, final norm, the head with its exact top
logits (data-dependent shapes) and sampling stay eager, once per step.

On the CPU a step then moves to the same layers compiled ahead of time into one C++ call
(engine/aot.py: a one-row and a batched package), bit for bit the per-layer graphs' results
without their per-layer Python cost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

from engine import aot
from engine.model import Block, CacheIndex, Transformer

log = logging.getLogger(__name__)


def use_cache_dir(cache_dir: str | Path | None) -> None:
    """Inductor reads its cache location from the environment, once; set it before compiling."""
    if cache_dir is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir) / "inductor"))


def _layer(block: Block, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, rows: Tensor,
           positions: Tensor, mask: Tensor) -> Tensor:
    # The span enters as the mask's length (a tensor's size can be dynamic in the graph, a
    # Python int would be specialized). Every slot's rows are in view and read by gather: inside
    # a graph the gather fuses into the float32 conversion attention does anyway.
    index = CacheIndex(0, keys.shape[0], mask.shape[-1], rows, positions, sliced=False)
    return block(x, cos, sin, keys, values, index, mask)


class CompiledDecode:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._layer = torch.compile(_layer, fullgraph=True, dynamic=None)
        self.packaged: list[aot.PackagedLayers] = []
        self.building: threading.Thread | None = None  # the packages' background build, if any

    def __call__(self, tokens: Tensor, slots: Tensor, positions: Tensor, span: int,
                 scratch: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """tokens, slots, positions: [B] long -> [B, dim] normalized residual (see Transformer.forward).
        scratch: K/V buffers shaped like a layer's that every layer writes instead of its own."""
        model = self.model
        x = model.embed(tokens.unsqueeze(1))
        rows, pos = slots.unsqueeze(1), positions.unsqueeze(1)
        index = CacheIndex(0, model.num_slots, span, rows, pos, sliced=False)
        cos, sin = model.rope(pos)
        mask = index.mask()
        if tokens.shape[0] > 1:
            for t in (x, cos, sin, rows, pos, mask):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(mask, mask.dim() - 1)
        if scratch is None:
            for packaged in self.packaged:
                if packaged.ready and packaged.fits(tokens.shape[0], span):
                    return model.last_normed(packaged(x, cos, sin, rows, pos, mask))
        for block in model.layers:
            keys, values = scratch or (block.k_cache, block.v_cache)
            x = self._layer(block, x, cos, sin, keys, values, rows, pos, mask)
        return model.last_normed(x)

    def warm(self, batches: list[int], span: int, ahead: bool = True, wait: bool = True) -> float:
        """Build the graphs for these batch sizes now. The layers write to scratch buffers shaped
        like theirs (the same graph, as guards see only shapes), so no slot's cache is touched.
        With `ahead` (CPU), then the steps compiled ahead of time: loaded if cached, else built
        now or (`wait=False`) in the background. Returns the seconds it took."""
        started = time.perf_counter()
        device = self.model.device
        first = self.model.layers[0]
        scratch = (torch.zeros_like(first.k_cache), torch.zeros_like(first.v_cache))
        with torch.inference_mode():
            for batch in batches:
                zeros = torch.zeros(batch, dtype=torch.long, device=device)
                self(zeros, torch.arange(batch, device=device), zeros, span, scratch)
        if ahead and device.type == "cpu":
            self.packaged, self.building = aot.prepare(self.model, wait)
        took = time.perf_counter() - started
        log.info("compiled decode for batches %s in %.1fs", batches, took)
        return took
