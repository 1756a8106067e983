"""The step, written once: what every layer reads, the layer loop, and the head.

A step is (1) the embedding lookup and the step's inputs (`StepInputs`: RoPE rows, the mask, where
each row's cache entries are), made eagerly once a step by `Transformer.step_inputs`; (2) the
layers and the head, `step_body`, the part a back-end may compile; (3) the exact top logits
(data-dependent shapes) and sampling, eagerly again. Every way of running it calls the same
functions here: eager (`Transformer.forward`, decode and prefill chunks alike), the per-layer
graphs (engine/compiled.py: `run_layers` with each layer's call compiled), the packages compiled
ahead of time (engine/aot.py exports `step_body`) and CUDA graphs (engine/graphs.py records the
compiled step). A new architecture adds its layers in engine/layers.py and, if its layers read
something new (a sliding window's mask, say), a field of `StepInputs` made in
`Transformer.step_inputs`: every back-end then runs it, since they pass the inputs on as a tuple
of tensors (`tensors` / `of`) and keep dynamic exactly the dims `dims` names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

from torch import Tensor

if TYPE_CHECKING:
    from engine.layers import Block
    from engine.model import Transformer

HeadOut = tuple[Tensor, Tensor, Tensor | None]  # the final-normed rows h, the head's logits, candidates
LayerCall = Callable[["Block", Tensor, "StepInputs", tuple[Tensor, ...]], Tensor]
# A back-end's run of `step_body`: embeddings [B, 1, dim] and the step's inputs -> HeadOut.
Body = Callable[[Tensor, "StepInputs"], HeadOut]


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one step reads beside the residual and its own state.

    Tensors (a compiled step's inputs, in field order, those not None): `rows` [B, 1] long, each
    row's slot in the state views; `positions` [B, T] long; `cos`, `sin` [B, T, hd] RoPE rows in
    float32; `mask` [B, 1, 1, T, span] bool, key j seen by a token at position p
    iff j <= p; `write_at` [B, T] long, where in the layers' K/V pools each new token's entries
    go, and `read_at` [B, span] long, where each position a row attends over is (both through
    the rows' block tables, `Transformer.pool_index`); where the model has sliding-window layers, what they read instead: `local_cos`,
    `local_sin` (their own RoPE base) and `local_mask` (also p - j < window); where it has
    recurrent layers, `state_at`. The rest is fixed
    for a compiled step: the state views are the layers' buffers' rows lo..hi-1 (hi None: all of
    them), and `sliced` says those rows are exactly the step's, in order (read as they are), else
    each row's are gathered."""

    rows: Tensor
    positions: Tensor
    cos: Tensor
    sin: Tensor
    mask: Tensor
    write_at: Tensor
    read_at: Tensor
    local_cos: Tensor | None = None
    local_sin: Tensor | None = None
    local_mask: Tensor | None = None
    # where the model has recurrent layers (Qwen3-Next's Gated DeltaNet): [B] long, each row's row
    # in their per-slot state views, a CUDA graph's padding rows (position ctx) the spare one
    state_at: Tensor | None = None
    lo: int = 0
    hi: int | None = None
    sliced: bool = False
    # A read of prompt tokens: their split at PROMPT_BLOCK edges (engine/model.py CacheIndex), one
    # call of each linear's prompt form per piece, and the fused attention; None: a decode step.
    pieces: tuple[int, ...] | None = None
    # An eager step's K/V reads, made once for all its layers (a compiled step has neither: its
    # graph makes and fuses its own gather from read_at): `kv_view`, (pool position of row 0's
    # position 0, distance between rows) where the rows' positions are one strided view of each
    # pool (`Transformer.kv_view`), else `kv_gather`, read_at flattened over the KV heads [B*KV*span].
    kv_view: tuple[int, int] | None = None
    kv_gather: Tensor | None = None

    # Dims beside dim 0 (the step's rows, dynamic in a batched step) whose size changes from step
    # to step: a compiled step keeps them dynamic.
    VARYING: ClassVar[dict[str, dict[int, str]]] = {"mask": {4: "span"}, "local_mask": {4: "span"},
                                                    "read_at": {1: "span"}}
    STATIC: ClassVar[tuple[str, ...]] = ("lo", "hi", "sliced", "pieces", "kv_view", "kv_gather")

    @property
    def span(self) -> int:
        """How many cache positions the step attends over (a dynamic size in a compiled step)."""
        return self.mask.shape[-1]

    def names(self) -> tuple[str, ...]:
        """The tensor fields this step has (not None), in field order."""
        return tuple(f.name for f in fields(self) if f.name not in self.STATIC and getattr(self, f.name) is not None)

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, name) for name in self.names())

    @classmethod
    def of(cls, tensors: Sequence[Tensor], names: Sequence[str]) -> "StepInputs":
        """`tensors()` (of a step with these `names()`) back into inputs over the whole buffers,
        each row's entries gathered: what a compiled step sees."""
        return cls(**dict(zip(names, tensors, strict=True)))

    def dims(self, batched: bool) -> list[dict[int, str]]:
        """For each of `tensors()`, its dynamic dims by name: "batch" (dim 0, batched steps only)
        and those VARYING names."""
        return [({0: "batch"} if batched else {}) | self.VARYING.get(name, {}) for name in self.names()]

    def attention(self, sliding: bool) -> tuple[Tensor, Tensor, Tensor]:
        """The RoPE rows and mask an attention layer reads: a sliding-window layer's own, if any."""
        if sliding and self.local_mask is not None:
            assert self.local_cos is not None and self.local_sin is not None
            return self.local_cos, self.local_sin, self.local_mask
        return self.cos, self.sin, self.mask

    def views(self, block: Block) -> tuple[Tensor, ...]:
        """The layer's state as this step sees it: buffers by slot (dim 0 "slots" in the mixer's
        STATE) as rows lo..hi-1, or all; a pool (the K/V blocks every slot shares) whole."""
        state = block.state()
        if self.hi is None:
            return state
        by_slot = [spec.get(0) == "slots" for spec in block.mixer.STATE.values()]
        return tuple(t[self.lo:self.hi] if slotted else t for t, slotted in zip(state, by_slot))


def call_layer(block: Block, x: Tensor, inputs: StepInputs, state: tuple[Tensor, ...]) -> Tensor:
    return block(x, inputs, state)


def run_layers(model: Transformer, x: Tensor, inputs: StepInputs, *, layer: LayerCall = call_layer,
               states: Sequence[tuple[Tensor, ...]] | None = None) -> Tensor:
    """The layer loop, the only one: x [B, T, dim] float32 embeddings -> the last layer's output
    [B, T, dim]. `layer` runs one layer (a compiled graph of it, say); `states` replaces each
    layer's own state views (scratch buffers to warm a graph on)."""
    for i, block in enumerate(model.layers):
        x = layer(block, x, inputs, inputs.views(block) if states is None else states[i])
    return x


def step_body(model: Transformer, x: Tensor, inputs: StepInputs, *, head: bool = True,
              layer: LayerCall = call_layer) -> tuple[Tensor, ...]:
    """The part of a step a back-end compiles: the layers, then (`head`) the final norm, the
    head's logits and the candidates for `Transformer.exact_top` (`Transformer.head_step`)."""
    x = run_layers(model, x, inputs, layer=layer)
    return model.head_step(x) if head else (x,)
