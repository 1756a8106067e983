"""The decode step's layers under torch.compile: fewer, fused kernels per token.

At batch 1 an eager step is mostly Python and kernel launches (~300 small ops for SmolLM2's 30
layers); a compiled layer fuses the norms, RoPE, softmax and residual adds around the matmuls.

The step is engine/step.py's (the same layer loop and head as eager): here `run_layers` calls
each layer through its compiled graph, and the packages ahead of time export `step_body`.

Regional: one layer is compiled, not the 30-layer model. Every layer has the same code and its
weights and K/V buffers go in as the graph's inputs, so dynamo traces once and inductor builds one
set of kernels that all layers run: the compile takes a layer's time, not the model's. Two graphs
cover every batch: one for a single row (sizes of 1 are always specialized) and one for 2+ rows
whose batch size and attention span are dynamic, so neither a new batch size nor a longer context
compiles again. The final norm, the head and its bound are one more graph (`_head`, also one row
and 2+ rows); the embedding lookup, RoPE rows, mask, the exact top logits (data-dependent shapes)
and sampling stay eager, once per step.

On the CPU the step runs compiled ahead of time instead, every layer and the head in one C++ call
(engine/aot.py: a one-row and a batched package), without the per-layer Python cost. The graphs
here are then never made: dynamo is not even started.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from functools import cached_property
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from engine import aot
from engine.graphs import GraphedDecode, Record, record_cuda
from engine.layers import Block
from engine.model import CacheIndex, Transformer
from engine.step import HeadOut, LayerCall, StepInputs, run_layers
from engine.weights import PackedLinear, TwoFormLinear

log = logging.getLogger(__name__)


def use_cache_dir(cache_dir: str | Path | None) -> None:
    """Inductor reads its cache location from the environment, once; set it before compiling."""
    if cache_dir is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir) / "inductor"))


def release_compile_workers() -> None:
    """Inductor keeps its compile processes (a sidecar and a pool of one per core, started for
    Triton's kernels) once a compile is done. A worker compiles only here, at start; on a GPU
    machine those processes took about a core while it served (docs/bench-log.md, "On a GPU"), as
    vLLM found before quiescing its pool ahead of recording CUDA graphs. A later compile, if
    any, starts them again. Not imported here if nothing compiled (the CPU's packages loaded)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.shutdown_compile_workers()


def _layer(block: Block, x: Tensor, state: tuple[Tensor, ...], names: tuple[str, ...], *inputs: Tensor) -> Tensor:
    # The inputs go in as tensors, so the span enters as the mask's length (a tensor's size can
    # be dynamic in the graph, a Python int would be specialized). Every slot's rows are in view
    # and read by gather: inside a graph the gather fuses into the float32 conversion attention
    # does anyway.
    return block(x, StepInputs.of(inputs, names), state)


def _compiled_layer(compiled: Callable[..., Tensor]) -> LayerCall:
    """`run_layers`' call of a layer through `compiled` (`_layer` under torch.compile)."""

    def layer(block: Block, x: Tensor, inputs: StepInputs, state: tuple[Tensor, ...]) -> Tensor:
        return compiled(block, x, state, inputs.names(), *inputs.tensors())
    return layer


def compilable(model: Transformer) -> bool:
    """Whether the layers' linears can go into a graph: oneDNN's prepacked bf16 linear (bf16
    without int4: --no-int4, F16 files) fails in inductor's lowering (an assertion on its
    arguments). The file's blocks through engine/quants' C++ op (`QuantLinear`, in layers or a
    K-quant head) compile: the op has a fake kernel (engine/quants/fake.py) and its blocks are
    the graph's inputs; only its decode form is in the graph, prompt tokens' bf16 slabs stay
    eager. A layer whose parts are of other types than its neighbours' (Q4_K_M's Q6_K v and down
    in some layers) is another graph. A TwoFormLinear's prepacked copy serves prefill only and
    does not count. Layers that read different RoPE rows and masks (Gemma 3's sliding layers,
    through StepInputs.local_*) compile like the others."""
    prefill_only = {id(m.packed) for m in model.layers.modules() if isinstance(m, TwoFormLinear)}
    return not any(isinstance(m, PackedLinear) and id(m) not in prefill_only for m in model.layers.modules())


def _scratch(model: Transformer) -> list[tuple[Tensor, ...]]:
    """For each layer, buffers shaped like its state, one set shared by the layers of a kind;
    made outside inference mode, like the real ones: the guards see how a tensor was made."""
    made: dict[tuple[object, ...], tuple[Tensor, ...]] = {}
    out = []
    for block in model.layers:
        state = block.state()
        key = (type(block.mixer), *((t.shape, t.dtype) for t in state))
        out.append(made.setdefault(key, tuple(torch.zeros_like(t) for t in state)))
    return out


class CompiledDecode:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.packaged: list[aot.PackagedStep] = []  # [one row, batched], all of them or none
        self.graphs: GraphedDecode | None = None  # CUDA: the steps recorded as graphs

    # made on first use: torch.compile starts dynamo (a second or more), which packages holding
    # the head never need
    @cached_property
    def _layer(self) -> Callable[..., Tensor]:
        return _compiled_layer(torch.compile(_layer, fullgraph=True, dynamic=None))

    @cached_property
    def _head(self) -> Callable[[Tensor], HeadOut]:
        # one graph for the final norm, the head and which logits to recompute exactly (eager
        # they were a dozen passes over the vocabulary)
        return torch.compile(self.model.head_step, fullgraph=True, dynamic=None)

    def __call__(self, tokens: Tensor, slots: Tensor, positions: Tensor, span: int,
                 allowed: Tensor | None = None, scored: Tensor | None = None) -> Tensor:
        """tokens, slots, positions: [B] long -> logits [B, V] float32 (Transformer.logits';
        allowed: constrained rows' tokens, scored: rows asking for logprobs, `Transformer.exact_top`)."""
        if self.graphs is not None:
            return self.graphs(tokens, slots, positions, span, allowed, scored)
        return self.model.exact_top(*self.step(tokens, slots, positions, span), allowed, scored)

    def step(self, tokens: Tensor, slots: Tensor, positions: Tensor, span: int,
             scratch: list[tuple[Tensor, ...]] | None = None) -> HeadOut:
        """The step up to the exact top logits: the final-normed rows, the head's logits and the
        candidates for `Transformer.exact_top`. scratch: per layer, buffers shaped like its state
        that it writes instead of its own."""
        index = CacheIndex(0, self.model.num_slots, span, slots.unsqueeze(1), positions.unsqueeze(1), sliced=False)
        return self.model.decode(tokens.unsqueeze(1), index, lambda x, inputs: self._body(x, inputs, scratch))

    def _body(self, x: Tensor, inputs: StepInputs, scratch: list[tuple[Tensor, ...]] | None = None) -> HeadOut:
        """`step.step_body` through the packages, or through the per-layer graphs and the head's."""
        batched = x.shape[0] > 1
        if self.packaged and scratch is None:
            step = self.packaged[batched]  # [one row, batched]
            out = step(x, inputs)
            if step.head:
                h, logits, *candidates = out
                return h, logits, candidates[0] if candidates else None
            x = out[0]
        else:
            for t, dims in zip((x, *inputs.tensors()), [{0: "batch"} if batched else {}] + inputs.dims(batched)):
                for dim in dims:
                    torch._dynamo.maybe_mark_dynamic(t, dim)
            x = run_layers(self.model, x, inputs, layer=self._layer, states=scratch)
        if batched:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        return self._head(x)

    def warm(self, batches: list[int], span: int, ahead: bool = True) -> float:
        """With `ahead` (CPU), the steps compiled ahead of time (engine/aot.py): loaded if cached,
        else built now. Without them (or if a build failed), the per-layer graphs for these batch
        sizes, built now on scratch buffers shaped like a layer's K/V (the same graph, as guards
        see only shapes), so no slot's cache is touched. Returns the seconds it took."""
        started = time.perf_counter()
        device = self.model.device
        if ahead and device.type == "cpu":
            packaged = aot.packages(self.model)
            aot.build(packaged)
            if all(p.ready for p in packaged):
                self.packaged = packaged
            else:  # every step through the same kernels: the per-layer graphs for all
                log.warning("decoding with the per-layer graphs: a step could not be compiled ahead of time")
        scratch = None if self.packaged else _scratch(self.model)
        with torch.inference_mode():
            if scratch is not None:
                for batch in batches:
                    zeros = torch.zeros(batch, dtype=torch.long, device=device)
                    self.step(zeros, torch.arange(batch, device=device), zeros, span, scratch)
            elif not self.packaged[0].head:  # only the head's graphs: the layers go through the packages
                for batch in batches:
                    x = torch.zeros(batch, 1, self.model.cfg.dim, device=device)
                    if batch > 1:
                        torch._dynamo.maybe_mark_dynamic(x, 0)
                    self._head(x)
        if device.type == "cuda":
            self._record_graphs()
        release_compile_workers()
        took = time.perf_counter() - started
        log.info("compiled decode for batches %s in %.1fs", batches, took)
        return took

    def _record_graphs(self, record: Record = record_cuda) -> None:
        """Every bucket's step as a CUDA graph (engine/graphs.py), or, if one cannot be recorded,
        none: every step then launches its kernels itself."""
        try:
            with torch.inference_mode():  # its buffers made as decode makes a step's inputs
                graphs = GraphedDecode(self.model, self.step, record)
                graphs.warm()
        except Exception:
            log.warning("decoding without CUDA graphs: a step could not be recorded", exc_info=True)
            return
        self.graphs = graphs
