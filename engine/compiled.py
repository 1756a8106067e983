"""The decode step's layers under torch.compile: fewer, fused kernels per token.

At batch 1 an eager step is mostly Python and kernel launches (~300 small ops for SmolLM2's 30
layers); a compiled graph fuses the norms, RoPE, softmax and residual adds around the matmuls.

Two graphs cover every batch: one for a single row (sizes of 1 are always specialized) and one
for 2+ rows whose batch size and attention span are dynamic, so neither a new batch size nor a
longer context compiles again. Each graph costs tens of seconds to build on 2 cores; `warm`
builds both at worker start, and inductor's caches live under the engine's cache folder, so a
restart reuses the generated code. Only the layers are compiled: the embedding lookup (quantized
rows), the head with its exact top logits (data-dependent shapes) and sampling stay eager.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch import Tensor

from engine.model import CacheIndex, Transformer

log = logging.getLogger(__name__)


def use_cache_dir(cache_dir: str | Path | None) -> None:
    """Inductor reads its cache location from the environment, once; set it before compiling."""
    if cache_dir is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir) / "inductor"))


class CompiledDecode:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._step = torch.compile(self._layers, fullgraph=True, dynamic=None)

    def _layers(self, x: Tensor, slots: Tensor, positions: Tensor, cols: Tensor) -> Tensor:
        # x: [B, 1, dim] float32; slots: [B]; positions: [B, 1]; cols: [span] (only its length is
        # used: a tensor's size can be dynamic in the graph, a Python int would be specialized).
        model = self.model
        # Every slot's rows in view, read by gather: inside a graph the gather fuses into the
        # float32 conversion attention does anyway, so it costs what slicing costs eagerly.
        index = CacheIndex(0, model.num_slots, cols.shape[0], slots.unsqueeze(1), positions, sliced=False)
        return model.run_layers(x, index)

    def __call__(self, tokens: Tensor, slots: Tensor, positions: Tensor, span: int) -> Tensor:
        """tokens, slots, positions: [B] long -> [B, dim] normalized residual (see Transformer.forward)."""
        x = self.model.embed(tokens.unsqueeze(1))
        cols = torch.empty(span, dtype=torch.int8, device=tokens.device)
        pos = positions.unsqueeze(1)
        if tokens.shape[0] > 1:
            for t in (x, slots, pos):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(cols, 0)
        return self._step(x, slots, pos, cols)

    def warm(self, batches: list[int], span: int) -> float:
        """Build the graphs for these batch sizes now (writing only to positions that a slot's
        next read overwrites: position 0 of the lowest slots). Returns the seconds it took."""
        started = time.perf_counter()
        device = self.model.device
        with torch.inference_mode():
            for batch in batches:
                zeros = torch.zeros(batch, dtype=torch.long, device=device)
                self(zeros, torch.arange(batch, device=device), zeros, span)
        took = time.perf_counter() - started
        log.info("compiled decode for batches %s in %.1fs", batches, took)
        return took
