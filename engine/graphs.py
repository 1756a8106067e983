"""Decode steps recorded as CUDA graphs, one per (rows, span) bucket, replayed every step.

On a GPU a small model's decode step is mostly kernel launches: ~20 a layer, each a few
microseconds of host work for far less on the device. A CUDA graph launches a recorded step's
kernels at once. A graph replays fixed shapes and addresses, so a step's tokens, slots and
positions are copied into buffers kept for the purpose, its rows padded up to a bucket (1, 2, 4,
... and the slot count) and its span one of decode's own (a multiple of KV_BUCKET, or ctx).

A padding row writes slot 0's spare cache position (`Transformer.allocate_cache` keeps one past
ctx, and its RoPE row) and no row ever reads it: a real row attends positions up to its own, at
most ctx - 1. Every bucket is recorded when the worker starts (`warm`), before it claims anything,
so a step never switches between a graph and the same kernels launched one by one.

The exact top logits (data-dependent shapes) and sampling run after the replay, as on the CPU.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import Tensor

from engine.model import KV_BUCKET, Transformer
from engine.step import HeadOut

log = logging.getLogger(__name__)

Step = Callable[[Tensor, Tensor, Tensor, int], HeadOut]  # tokens, slots, positions [B] long, span
Replay = Callable[[], None]
# (run once -> its outputs, memory pool) -> (replay: run again into those outputs, them, the pool)
Record = Callable[[Callable[[], HeadOut], object], tuple[Replay, HeadOut, object]]


def row_buckets(num_slots: int) -> list[int]:
    """Powers of two below num_slots, then num_slots: a step of n rows runs the first bucket >= n."""
    buckets = [1]
    while buckets[-1] * 2 < num_slots:
        buckets.append(buckets[-1] * 2)
    return buckets + ([num_slots] if num_slots > 1 else [])


def spans(ctx: int) -> list[int]:
    """Every span decode asks for: the longest row rounded up to KV_BUCKET, at most ctx."""
    return [min(ctx, top) for top in range(KV_BUCKET, ctx + KV_BUCKET, KV_BUCKET)]


def record_cuda(run: Callable[[], HeadOut], pool: object) -> tuple[Replay, HeadOut, object]:
    """Run the step once outside a graph (compiles, autotunes, creates cuBLAS handles; PyTorch
    asks for this warm-up on a side stream), then record it into a graph sharing `pool` with
    the others (one step replays at a time, so their intermediates may share memory)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    return graph.replay, outputs, graph.pool()


class GraphedDecode:
    """`step` (the compiled decode step without the exact top logits) replayed from recordings."""

    def __init__(self, model: Transformer, step: Step, record: Record = record_cuda) -> None:
        self.model, self.step, self.record = model, step, record
        self.rows = row_buckets(model.num_slots)
        size, device = self.rows[-1], model.device
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.full((size,), model.ctx, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[Replay, HeadOut]] = {}
        self._pool: object = None

    def __call__(self, tokens: Tensor, slots: Tensor, positions: Tensor, span: int,
                 allowed: Tensor | None = None, scored: Tensor | None = None) -> Tensor:
        """tokens, slots, positions: [n] long -> logits [n, V] float32 (Transformer.logits'), a
        view of the recording's output: read it before the next step (allowed, scored: exact_top's)."""
        n = tokens.shape[0]
        rows = next(r for r in self.rows if r >= n)
        graph = self.graphs.get((rows, span)) or self._record(rows, span)
        self._pad(n, rows)
        self.tokens[:n].copy_(tokens)
        self.slots[:n].copy_(slots)
        self.positions[:n].copy_(positions)
        replay, (h, logits, candidates) = graph
        replay()
        return self.model.exact_top(h[:n], logits[:n], None if candidates is None else candidates[:n], allowed, scored)

    def warm(self) -> float:
        """Record every (rows, span) bucket now. Returns the seconds it took."""
        started = time.perf_counter()
        for span in spans(self.model.ctx):
            for rows in self.rows:
                self._record(rows, span)
        took = time.perf_counter() - started
        log.info("recorded %d decode steps as CUDA graphs (rows %s, spans up to %d) in %.1fs",
                 len(self.graphs), self.rows, self.model.ctx, took)
        return took

    def _record(self, rows: int, span: int) -> tuple[Replay, HeadOut]:
        self._pad(0, rows)  # every row a padding row: recording writes no slot's cache

        def run() -> HeadOut:
            return self.step(self.tokens[:rows], self.slots[:rows], self.positions[:rows], span)

        replay, outputs, self._pool = self.record(run, self._pool)
        self.graphs[(rows, span)] = (replay, outputs)
        return replay, outputs

    def _pad(self, n: int, rows: int) -> None:
        """Rows n..rows-1 of the bucket are padding (the rows past it the graph never reads)."""
        self.tokens[n:rows].zero_()
        self.slots[n:rows].zero_()
        self.positions[n:rows].fill_(self.model.ctx)
