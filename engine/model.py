"""A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3 shapes) with a KV cache per slot.

One forward for every step, under the caller's `torch.inference_mode()`: `Transformer.forward`
takes B rows of T tokens (a prefill chunk is B=1, a decode step T=1), the `CacheIndex` saying
which slots' cache entries the step reads and writes, and returns the float32 residual of each
row's last token; `Transformer.logits` turns that into logits. The step itself (its inputs, the
layer loop, the head) is engine/step.py's, which every back-end runs; the layers are
engine/layers.py's, chosen per layer in `build`.

Weights come from an `engine.weights.WeightSource` (the loaders undo file-format quirks) under the
names listed in `WEIGHT_NAMES`; `Transformer.build` keeps one copy of each matrix in the form the
step uses (see engine/weights.py) and fuses q/k/v and gate/up into single matrices, since at
batch 1 every extra op is Python overhead that dominates the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import kv_dtype
from engine.deltanet import DeltaNetShape, GatedDeltaNet
from engine.layers import Attention, Block, GatedFFN, gather_index
from engine.exact_head import exact_logits
from engine.memory import ensure_kv_fits
from engine.moe import Experts
from engine.quants.blocks import (INT4_TYPES, BlocksPart, QuantExperts, QuantLinear, QuantRows, available as quants_available,
                                  bf16_prompt_here, repack_here)
from engine.rope import RopeScaling, tables
from engine.step import Body, HeadOut, StepInputs, run_layers, step_body
from engine.weights import (
    DenseLinear, DenseRows, HeadBound, Int4Linear, Int8Linear, PackedLinear, RowTable, TwoFormLinear, WeightSource,
    can_prepack, dequantize_int4, fuse_int4, int4_available, int4_shape_ok, int8_available, int8_shape_ok, in_pieces,
)

log = logging.getLogger(__name__)

# Per-layer weight names the loaders produce (prefix "layers.{i}."); optional ones may be absent.
WEIGHT_NAMES = (
    "attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down",  # always
    "q_bias", "k_bias", "v_bias", "q_norm", "k_norm",  # Qwen2 biases, Qwen3 q/k norms
    # an MoE layer instead of gate/up/down (engine/moe.py): router [E, dim], experts_gate/up
    # [E, I, dim], experts_down [E, dim, I]; a shared expert's shared_gate/up/down and its
    # shared_router [1, dim]
    "router", "experts_gate", "experts_up", "experts_down",
    "shared_gate", "shared_up", "shared_down", "shared_router",
    "post_attn_norm", "post_ffn_norm",  # Gemma 3: norms of the attention's and the FFN's outputs
    "q_gate",  # Qwen3-Next's gated attention: the gate's rows of its joint q projection
    # Qwen3-Next's Gated DeltaNet layers (engine/deltanet.py) instead of q/k/v/o: the input
    # projection's parts (q, k, v of every head in one matrix, then z, b, a), the convolution
    # [conv_dim, kernel], dt_bias, a = -exp(A_log), the per-head norm and the output projection
    "lin_qkv", "lin_z", "lin_b", "lin_a", "lin_conv", "lin_dt_bias", "lin_a_neg", "lin_norm", "lin_out",
)
# Whole-model names: "embed", "norm", and "output" unless the embeddings are tied.

# Decode attends over the cache sliced to the longest active row, rounded up to this, so the
# shapes (and a compiled graph's) change only every BUCKET tokens.
KV_BUCKET = 256
# A prompt's tokens go through the linears in aligned blocks of this many positions, one call
# each: oneDNN's bf16 kernels (AMX or AVX512) choose their blocking by a call's rows, so a row's
# result depends on how many rows share its call. Cut at fixed positions, a prompt token is
# computed the same way whatever chunk carried it; a reused cached prefix ends on a block edge.
PROMPT_BLOCK = 64
# The KV pool's block: positions per entry of a slot's block table. A prompt block, so a prefix
# reused from the pool ends on a prompt block's edge (exact repeats) and a block is the unit the
# worker's bookkeeping (workers/blocks.py) hands out, keys and evicts.
KV_BLOCK = PROMPT_BLOCK


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_positions: int = 8192  # what the model was trained for (informational)
    rope_scaling: RopeScaling = RopeScaling()  # as the config declares it (engine/rope.py)
    n_experts_used: int = 0  # MoE layers (those with a router): experts per token
    norm_topk: bool = True  # MoE: the chosen experts' weights renormalized to sum to one
    # Gemma 3 (and Mistral's window): which layers attend over the last `sliding_window` positions
    # only, with their own RoPE base (0: the global one, unscaled either way)
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float = 0.0
    attn_scale: float = 0.0  # scores' factor; 0: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) where set (Gemma 3's final_logit_softcapping)
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma: sqrt(dim))
    activation: str = "silu"  # the gated FFN's: "silu" or "gelu_tanh" (Gemma)
    # Qwen3-Next: which layers are Gated DeltaNet ("linear") instead of attention, their shape;
    # RoPE on the first `rotary_dim` dims of a head only (0: all); the attention's output gate
    linear_layers: tuple[bool, ...] = ()
    linear: DeltaNetShape | None = None
    rotary_dim: int = 0
    attn_gate: bool = False

    def is_linear(self, layer: int) -> bool:
        return layer < len(self.linear_layers) and self.linear_layers[layer]

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state per slot (which cannot go back a position)."""
        return any(self.linear_layers)

    @property
    def n_attention_layers(self) -> int:
        return self.n_layers - sum(self.linear_layers)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int]:
        """One layer's K (or V) pool of `num_tokens` positions, one spare block beyond them (what
        no table holds: padding rows and unassigned table entries point there)."""
        return (self.n_kv_heads, num_tokens + KV_BLOCK, self.head_dim)

    def kv_cache_bytes(self, num_tokens: int, dtype: torch.dtype) -> int:
        """Every attention layer's K and V pools together, in `dtype` entries (engine/kv_dtype.py)."""
        kv, tokens, head_dim = self.kv_shape(num_tokens)
        return 2 * self.n_attention_layers * kv * tokens * kv_dtype.entry_bytes(head_dim, dtype)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What one position costs in every attention layer's K and V pools (`--kv-dtype`)."""
        return 2 * self.n_attention_layers * self.n_kv_heads * kv_dtype.entry_bytes(self.head_dim, dtype)

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window > 0 and layer < len(self.sliding_layers) and self.sliding_layers[layer]

    @property
    def local_rope(self) -> bool:
        """Whether sliding layers read RoPE rows of their own."""
        return any(self.sliding_layers) and self.rope_local_theta > 0



@dataclass(frozen=True)
class CacheIndex:
    """Which cache entries one step reads and writes; the same for every layer.

    The step's views of a layer's K/V buffer are `buffer[lo:hi, :, :span]`. Row b of the step
    writes its T new entries at view row `rows[b]`, positions `positions[b]`; it reads view row
    `rows[b]` too, so when the step's slots are exactly lo..hi-1 in order (`sliced`) the read is
    the view itself, and otherwise a gather of those rows.

    `reading`: the step reads prompt tokens (`TorchEngine.read`), otherwise it feeds generated
    tokens (a decode step); `pieces` splits a read's tokens at multiples of PROMPT_BLOCK
    positions. That, not the chunk's length, picks the kernels: a prompt token goes through the
    prompt forms (a linear's `prompt_form`, one call per piece; fused attention) and a generated
    one through the decode forms, so a token's KV and logits do not depend on how its prompt was
    chunked or cached, nor on its batch (docs/engine.md, "Exact repeats").
    """

    lo: int
    hi: int
    span: int
    rows: Tensor  # [B, 1] long, row in the view
    positions: Tensor  # [B, T] long
    sliced: bool
    reading: bool = False
    pieces: tuple[int, ...] = ()  # a read: its tokens' split at block boundaries (sums to T)
    # An eager step's rows on the host: each row's slot and how many positions it holds once the
    # step wrote them, so `Transformer.step_inputs` can read them without a device round trip
    # (a strided view, `Transformer.kv_view`); empty: a compiled step's index, which needs neither.
    slots: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()

    @classmethod
    def for_slots(cls, slots: list[int], positions: Tensor, span: int, ends: Sequence[int] = ()) -> "CacheIndex":
        lo, hi = min(slots), max(slots) + 1
        rows = torch.tensor([s - lo for s in slots], dtype=torch.long, device=positions.device).unsqueeze(1)
        return cls(lo, hi, span, rows, positions, sliced=slots == list(range(lo, hi)), slots=tuple(slots),
                   ends=tuple(ends))

    @classmethod
    def for_read(cls, slot: int, start: int, end: int, device: torch.device | None = None) -> "CacheIndex":
        """Prompt tokens start..end-1 of one slot, split into pieces at multiples of PROMPT_BLOCK."""
        cuts = [start, *range((start // PROMPT_BLOCK + 1) * PROMPT_BLOCK, end, PROMPT_BLOCK), end]
        positions = torch.arange(start, end, device=device).unsqueeze(0)
        return cls(slot, slot + 1, end, torch.zeros(1, 1, dtype=torch.long, device=device), positions, sliced=True,
                   reading=True, pieces=tuple(b - a for a, b in zip(cuts, cuts[1:])), slots=(slot,), ends=(end,))

    def mask(self, window: int = 0) -> Tensor:
        """[B, 1, 1, T, span] bool: key j is seen by a token at position p iff j <= p (causal
        inside a chunk, everything cached before it visible, stale entries past it hidden), and
        with a window, p - j < window (the last `window` positions, its own included)."""
        cols = torch.arange(self.span, device=self.positions.device).view(1, 1, self.span)
        bsz, seq = self.positions.shape
        positions = self.positions.unsqueeze(-1)
        seen = cols <= positions
        if window:
            seen = seen & (cols > positions - window)
        return seen.view(bsz, 1, 1, seq, self.span)



class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(self.make_block(i) for i in range(cfg.n_layers))
        # read by every step (`step_inputs`): kept on the host rather than found by walking the
        # layers through nn.Module's attribute lookups each time (with `span_index`, the step's
        # inputs 0.82 -> ~0.4 ms at one row: docs/bench-log.md, Dec 7 ninth session)
        self.window = max((getattr(b.mixer, "window", 0) for b in self.layers), default=0)
        self.attention_mixers = tuple(b.mixer for b in self.layers if isinstance(b.mixer, Attention))
        self.embed: RowTable | None = None
        self.norm = torch.empty(0)
        self.head: nn.Module = nn.Identity()
        # A low-precision head: the exact rows for its top logits, and how far off its logits can be.
        self.head_rows: RowTable | None = None
        self.head_bound: HeadBound | None = None
        self.dtype = self.cache_dtype = torch.float32
        self.device = torch.device("cpu")
        self.cos = self.sin = torch.empty(0)
        self.cos_local = self.sin_local = torch.empty(0)  # sliding layers' RoPE rows (cfg.local_rope)
        self.num_slots = 0
        self.ctx = 0
        self.kv_block = KV_BLOCK
        self.num_kv_blocks = self.spare_block = 0
        self.tables = torch.empty(0, dtype=torch.long)  # [slots, ctx / KV_BLOCK] pool block ids (allocate_cache)
        # per slot, on the host: its table's first block and how many blocks from it are consecutive
        # in the pool (a run: its positions are one slice of each pool, `kv_view`)
        self.runs: list[tuple[int, int]] = []
        self.forms: dict[str, int] = {}  # linear form -> count, for logs and tests

    # ---- set-up ---------------------------------------------------------------------------

    def make_block(self, i: int) -> Block:
        """Layer i's parts, as its architecture has them (its weights come in `build`): the
        place where a sliding-window, recurrent or expert layer is chosen."""
        cfg = self.cfg
        if cfg.is_linear(i):
            assert cfg.linear is not None
            return Block(cfg.dim, cfg.norm_eps, GatedDeltaNet(cfg.linear, cfg.norm_eps), GatedFFN(cfg.activation))
        window = cfg.sliding_window if cfg.is_sliding(i) else 0
        return Block(cfg.dim, cfg.norm_eps,
                     Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps, window=window, scale=cfg.attn_scale,
                               gated=cfg.attn_gate),
                     GatedFFN(cfg.activation))

    @classmethod
    def build(cls, cfg: ModelConfig, source: WeightSource, *, dtype: torch.dtype, device: torch.device,
              int4: bool = False, prepack: bool = True, prefill_bf16: bool = False,
              prompt_int8: bool = True, repack: bool = True) -> "Transformer":
        """One copy of each weight in the form the step uses:
        - linears: quantized types as the file's blocks (`QuantLinear`; Q4_0/Q4_1 repacked where
          engine/quants' AVX2 builds run, Q4_1's with 16-bit activations, Q4_0's with int8 ones); Q4_0/Q4_1 with `int4` on
          torch's int4 kernel instead where those do not (`repack_here`) and oneDNN prepacks bf16;
          else dense `dtype`, prepacked by oneDNN for CPU bf16; with `prefill_bf16` a Q4_0/Q4_1
          matrix also keeps a bf16 prepacked copy for prefill chunks where oneDNN prepacks bf16
          and no bf16 tile reads their prompts from the blocks (`bf16_prompt_here`, with
          `prompt_int8`: AVX-512 BF16 without AMX) (`TwoFormLinear`: the one exception to one copy);
          a `QuantLinear`'s prompt tokens in int8 with `prompt_int8` where the CPU runs that
          faster (`int8_prompt_here`), else through bf16 slabs; its parts repacked
          eight rows at a time for the decode step with `repack` (engine/quants/blocks.py
          `repacked`), their file pages dropped from the process as soon as they are;
        - embedding: a row table (a quantized file's own blocks, looked up and dequantized per
          token), so no dense copy;
        - head: int8 per row on the CPU with bf16 (half the bytes of bf16; int4's error bound
          covered most of the vocabulary), else `dtype`, prepacked on CPU; with the exact rows
          for the top logits and the head's error bound (`logits`).
        The residual stream and the RMSNorm weights are float32 whatever `dtype`."""
        model = cls(cfg)
        # The KV pool's entries (engine/kv_dtype.py; load_engine's --kv-dtype may change them):
        # attention computes in float32 whatever they are (bf16 scores are 1/8-1/4 apart at 16-64).
        model.device, model.dtype = device, dtype
        model.cache_dtype = kv_dtype.resolve(None, device, dtype)
        cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
        use_packed = prepack and cpu_bf16 and can_prepack()
        use_quant = cpu_bf16  # the file's blocks through engine/quants' kernels, where the source has them
        # Q4_0/Q4_1 on torch's int4 kernel only where engine/quants' eight-row dots do not run and
        # oneDNN prepacks their bf16 prompt copy: those dots (Q4_1's 16-bit activations finer than the int4
        # kernel's bf16) beat it 2.6x at one row, 1.2x at four, and on AVX2 alone even the one-row
        # dots do (docs/bench-log.md, Dec 6 and Dec 7 fourth session)
        use_int4 = int4 and cpu_bf16 and int4_available() and (
            not quants_available() or (can_prepack() and not repack_here()))
        # where the blocks' own bf16 tile reads Q4_1 prompts (Q4_0's go in int8), no bf16 copy is made:
        # 0.90x the copy's prompt rate on a 1.7B Q4_0 for 2.8 GB less (docs/bench-log.md, Dec 7
        # fifth session)
        prompt_copy = prefill_bf16 and use_packed and not (prompt_int8 and bf16_prompt_here())
        names = source.names()

        def vector(name: str) -> Tensor:
            return source.dense(name).to(device=device, dtype=torch.float32)

        def linear(parts: list[str], bias: list[str] | None = None) -> nn.Module:
            b = torch.cat([vector(n) for n in bias]) if bias else None
            if use_int4:
                blocks = [source.int4(n) for n in parts]
                fused = fuse_int4(blocks) if all(x is not None for x in blocks) else None  # type: ignore[arg-type]
                if fused is not None and int4_shape_ok(fused):
                    if prefill_bf16 and use_packed:
                        packed = PackedLinear(dequantize_int4(fused).to(torch.bfloat16), b)
                        return counted("int4+bf16-packed",
                                       TwoFormLinear(Int4Linear(fused, b), packed))
                    return counted("int4", Int4Linear(fused, b))
            if use_quant:
                held = [source.quant(n) for n in parts]
                if all(q is not None and (int4 or q.qtype not in INT4_TYPES) for q in held):
                    # Q4_K parts on `mm` (its fused dot beat torch's int4 kernel in the engine, Dec 6)
                    module = QuantLinear(held, b, int8_prompt=prompt_int8, repack=repack)  # type: ignore[arg-type]
                    copy = None  # Q4_0/Q4_1's bf16 prompt copy, as int4's (their prompts' precision)
                    if prompt_copy and any(q.qtype in INT4_TYPES for q in held):  # type: ignore[union-attr]
                        copy = PackedLinear(torch.cat([source.dense(n) for n in parts]).to(torch.bfloat16), b)
                    if (release := getattr(source, "release", None)) is not None:  # a GGUF file's pages
                        # (no int4 run here: module.parts are `parts`, one each)
                        for name, part in zip(parts, module.parts):
                            if isinstance(part, BlocksPart) and part.repacked:
                                release(name)
                    if copy is not None:
                        return counted("quant+bf16-packed", TwoFormLinear(module, copy))
                    return counted("quant", module)
            weight = torch.cat([source.dense(n) for n in parts]).to(dtype)
            if use_packed:
                return counted("bf16-packed", PackedLinear(weight, b))
            return counted(f"{str(dtype).removeprefix('torch.')}-dense",
                           DenseLinear(weight.to(device), None if b is None else b.to(dtype)))

        def counted(form: str, module: nn.Module) -> nn.Module:
            model.forms[form] = model.forms.get(form, 0) + 1
            return module

        def experts(p: str) -> Experts:
            shared = None
            if p + "shared_router" in names:  # [1, dim] (a GGUF's ffn_gate_inp_shexp is [dim])
                dense = GatedFFN()
                dense.w_gate_up, dense.w_down = linear([p + "shared_gate", p + "shared_up"]), linear([p + "shared_down"])
                shared = (dense, vector(p + "shared_router").reshape(1, -1))
            # A quantized file's experts stay its blocks where engine/quants runs (any type it takes);
            # elsewhere they are dense in the activations' dtype (a quantized file's dequantized).
            held = [source.quant(p + n) for n in ("experts_gate", "experts_up", "experts_down")] if use_quant else []
            if held and all(h is not None for h in held):
                return counted("quant-experts", Experts.of_blocks(vector(p + "router"), *(QuantExperts(h) for h in held),
                                                                  cfg.n_experts_used, cfg.norm_topk, shared))
            gate_up = torch.cat([source.dense(p + "experts_gate"), source.dense(p + "experts_up")], dim=1)
            return counted("experts", Experts(vector(p + "router"), gate_up.to(device=device, dtype=dtype),
                                              source.dense(p + "experts_down").to(device=device, dtype=dtype),
                                              cfg.n_experts_used, cfg.norm_topk, shared))

        for i, block in enumerate(model.layers):
            p = f"layers.{i}."
            block.attn_norm, block.ffn_norm = vector(p + "attn_norm"), vector(p + "ffn_norm")
            mixer, ffn = block.mixer, block.ffn
            if isinstance(mixer, GatedDeltaNet):
                mixer.w_in = linear([p + "lin_qkv", p + "lin_z", p + "lin_b", p + "lin_a"])
                mixer.w_out = linear([p + "lin_out"])
                mixer.conv, mixer.dt_bias = vector(p + "lin_conv"), vector(p + "lin_dt_bias")
                mixer.a, mixer.norm = vector(p + "lin_a_neg"), vector(p + "lin_norm")
            else:
                if cfg.qk_norm:
                    mixer.q_norm, mixer.k_norm = vector(p + "q_norm"), vector(p + "k_norm")
                mixer.wqkv = linear([p + "q", p + "k", p + "v"] + ([p + "q_gate"] if cfg.attn_gate else []),
                                    [p + "q_bias", p + "k_bias", p + "v_bias"] if cfg.qkv_bias else None)
                mixer.wo = linear([p + "o"])
            if p + "post_attn_norm" in names:
                block.post_attn_norm = vector(p + "post_attn_norm")
            if p + "post_ffn_norm" in names:
                block.post_ffn_norm = vector(p + "post_ffn_norm")
            if p + "router" in names:
                block.ffn = experts(p)  # the layer's FFN: experts instead of the dense one
            else:
                ffn.w_gate_up = linear([p + "gate", p + "up"])
                ffn.w_down = linear([p + "down"])
        head_name = "embed" if cfg.tie_embeddings or "output" not in names else "output"
        model.norm = vector("norm")
        model.embed = rows_on(device, source, "embed")
        if dtype == torch.float32:
            weight = source.dense(head_name).to(device)
            model.head = DenseLinear(weight)
            if head_name == "embed" and device.type == "cpu":
                model.embed = DenseRows(weight)  # one float32 copy serves both
        elif (held := source.quant(head_name) if use_quant else None) is not None:
            # A quantized head (the default's tied Q8_0 embedding, Q6_K in Q4_K_M files): the
            # file's blocks, one copy for the head, its exact rows and the embedding if tied,
            # dotted with the float32 residual (engine/quants' `mm`, faster than an int8 copy's
            # kernel at 1-16 rows: bench/head_speed.py). Its logits are the exact rows' own
            # product, so it needs no bound and no recomputation (`exact_top` does nothing): a
            # row that asks for logprobs reports the logits every row samples from.
            model.head = QuantLinear([held], slabs=False, int8_x=False)
            model.head_rows = QuantRows(held)
            if head_name == "embed":
                model.embed = model.head_rows
        else:
            exact = source.dense(head_name)
            effective: Callable[[slice], Tensor]
            if cpu_bf16 and int8_available() and int8_shape_ok(exact):
                head = Int8Linear(exact)
                model.head, effective = head, head.dequantized
            else:
                weight = exact.to(dtype)
                model.head = PackedLinear(weight) if use_packed else DenseLinear(weight.to(device))
                effective = lambda rows: weight[rows].float()  # noqa: E731
            # cuBLAS may add split-K partial sums in bf16; allow a few such roundings there.
            model.head_bound = HeadBound(exact, effective, reduced_sums=4 if device.type == "cuda" else 0).to(device)
            if model.head_rows is None:
                model.head_rows = model.embed if head_name == "embed" else rows_on(device, source, head_name)
            del exact, effective
        if isinstance(model.embed, nn.Module):
            model.embed.to(device)
        if isinstance(model.head_rows, nn.Module):
            model.head_rows.to(device)
        return model.eval()

    def allocate_cache(self, num_slots: int, ctx: int, kv_tokens: int | None = None) -> None:
        """Each attention layer's K and V pools of `kv_tokens` positions in blocks of KV_BLOCK
        (None: num_slots x ctx, every slot's own blocks), and each slot's block table: which pool
        block holds its positions b*KV_BLOCK.. (b+1)*KV_BLOCK - 1 (`assign`). One K and one V
        buffer per layer: a single shared buffer made writes copy it whole. A request may hold up
        to `ctx` positions (the model's length), its blocks wherever the pool has them."""
        cfg, bs = self.cfg, KV_BLOCK
        per_slot = -(-ctx // bs)
        num_blocks = num_slots * per_slot if kv_tokens is None else kv_tokens // bs
        if num_blocks < 1:
            raise ValueError(f"a KV pool of {kv_tokens} tokens holds no block of {bs}")
        tokens = num_blocks * bs
        # refused before any buffer: zeros past the free memory allocate, and fail only when written
        states = 0 if cfg.linear is None else (num_slots + 1) * sum(cfg.linear_layers) * cfg.linear.state_bytes()
        ensure_kv_fits(cfg.kv_cache_bytes(tokens, self.cache_dtype) + states, self.device, tokens)
        for block in self.layers:
            block.allocate(tokens, self.device, self.cache_dtype, bs, num_slots)
        self.kv_block, self.num_kv_blocks = bs, num_blocks
        # the spare block's id: an entry no slot was given (read masked) and what padding rows write
        self.spare_block = num_blocks
        self.tables = torch.full((num_slots, per_slot), num_blocks, dtype=torch.long, device=self.device)
        self.runs = [(num_blocks, 0)] * num_slots
        if num_blocks >= num_slots * per_slot:  # each slot its own run of blocks until told otherwise
            self.tables.copy_(torch.arange(num_slots * per_slot, device=self.device).view(num_slots, per_slot))
            self.runs = [(s * per_slot, per_slot) for s in range(num_slots)]
        # Rows for position ctx too: a CUDA graph's padding rows sit there (engine/graphs.py).
        # Tables in float32 (angles past a few hundred lose their low bits in bf16); each step
        # rounds the rows it uses to the activations' dtype, as transformers does.
        cos, sin = tables(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, ctx + 1, ctx)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        if cfg.local_rope:  # Gemma 3's sliding layers: their own base, no scaling
            cos, sin = tables(cfg.rope_dim, cfg.rope_local_theta, RopeScaling(), ctx + 1, ctx)
            self.cos_local, self.sin_local = cos.to(self.device), sin.to(self.device)
        self.num_slots, self.ctx = num_slots, ctx

    def copy_slot(self, source: int, targets: Sequence[int], length: int) -> None:
        """The K/V entries of `source`'s first `length` positions into the same positions of every
        slot of `targets`, through their block tables (which must hold them): sibling answers of one
        request (`n`) start from one read this way. A block the tables share (a prefix the worker's
        pool gave both) is copied onto itself, unchanged. A recurrent layer's state (per slot,
        valid at `length`, the source's position) is copied whole."""
        with torch.inference_mode():
            positions = torch.arange(length, device=self.device).unsqueeze(0)
            at = self.pool_index(torch.tensor([source], device=self.device), positions)[0]
            for target in targets:
                to = self.pool_index(torch.tensor([target], device=self.device), positions)[0]
                for block in self.layers:
                    for name, dims in type(block.mixer).STATE.items():
                        buffer = getattr(block.mixer, name)
                        if dims.get(0) == "slots":
                            buffer[target] = buffer[source]
                        else:
                            buffer[:, to] = buffer[:, at]

    def assign(self, slot: int, blocks: list[int]) -> None:
        """The slot's block table from now on: its positions live in these pool blocks, in order
        (the rest of its table: the spare block). In place, so a recorded CUDA graph reads it."""
        if len(blocks) > self.tables.shape[1]:
            raise ValueError(f"slot {slot}: {len(blocks)} blocks exceed ctx={self.ctx}")
        if any(not 0 <= b < self.num_kv_blocks for b in blocks):
            raise ValueError(f"slot {slot}: a block id outside the pool's {self.num_kv_blocks}")
        row = torch.full((self.tables.shape[1],), self.spare_block, dtype=torch.long)
        row[:len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        self.tables[slot].copy_(row)
        run = 1 if blocks else 0
        while run < len(blocks) and blocks[run] == blocks[0] + run:
            run += 1
        self.runs[slot] = (blocks[0] if blocks else self.spare_block, run)

    @property
    def reads_in_place(self) -> bool:
        """Whether a decode step's attention layers read the KV pool where it lies (engine/attend.cpp,
        set per layer by `Attention.allocate`): then the step needs neither a view nor a gather."""
        return all(mixer.in_place for mixer in self.attention_mixers)

    def kv_view(self, index: CacheIndex) -> tuple[int, int] | None:
        """Where an eager decode step may read its rows' K/V as one strided view of each pool
        instead of a gather: (the pool position of row 0's position 0, the distance from a row's to
        the next's), or None. It may when every row's written positions lie in its table's first
        run of consecutive blocks, the runs start equally spaced in row order, and each row's span
        stays inside the pool: a fresh pool's slots (each its own run, as the contiguous cache had
        them) and any consecutive blocks the worker's pool gave a slot. Positions past a row's own
        are other blocks' entries (finite) where the gather read the spare block; the mask hides
        both, and a hidden key's probability is exactly 0, so the logits are the gather's bit for
        bit (tests/engine/test_kv_pool.py). Not for reads: their fused attention keeps the gather."""
        if index.reading or not index.ends:
            return None
        bs, pool = self.kv_block, self.kv_pool_length
        firsts = []
        for slot, end in zip(index.slots, index.ends, strict=True):
            first, run = self.runs[slot]
            if run * bs < end or first * bs + index.span > pool:
                return None
            firsts.append(first)
        stride = firsts[1] - firsts[0] if len(firsts) > 1 else 0
        if stride < 0 or any(f != firsts[0] + b * stride for b, f in enumerate(firsts)):
            return None
        return firsts[0] * bs, stride * bs

    def pool_index(self, slots: Tensor, positions: Tensor) -> Tensor:
        """slots [B], positions [B, L] long -> [B, L] each position's place in the layers' pools,
        through the slots' block tables; positions at ctx or past it (padding rows) -> the spare block."""
        bs = self.kv_block
        col = (positions // bs).clamp(max=self.tables.shape[1] - 1)
        at = self.tables[slots.unsqueeze(1), col] * bs + positions % bs
        return torch.where(positions < self.ctx, at, self.spare_block * bs)

    def span_index(self, slots: Tensor, span: int) -> Tensor:
        """slots [B] long -> [B, span]: `pool_index` of positions 0..span-1 of each slot, from
        whole rows of the block tables (a few small ops a step rather than pool_index's dozen)."""
        if span > self.ctx:  # past the tables (a caller's span rounded up): pool_index's clamps
            return self.pool_index(slots, torch.arange(span, device=self.device).expand(len(slots), span))
        bs = self.kv_block
        rows = self.tables[slots, :-(-span // bs)].unsqueeze(-1) * bs + torch.arange(bs, device=self.device)
        return rows.flatten(1)[:, :span].contiguous()

    def slot_kv(self, slot: int, n: int) -> Tensor:
        """[layers, 2, KV, n, hd]: the K and V entries of the slot's first n positions, read through
        its table (tests compare caches with it)."""
        at = self.pool_index(torch.tensor([slot], device=self.device), torch.arange(n, device=self.device).unsqueeze(0))[0]
        return torch.stack([torch.stack([b.mixer.k_cache[:, at], b.mixer.v_cache[:, at]]) for b in self.layers
                            if isinstance(b.mixer, Attention)])

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for block in self.layers for t in block.state())

    # ---- forward --------------------------------------------------------------------------

    def forward(self, tokens: Tensor, index: CacheIndex) -> Tensor:
        """tokens: [B, T] at index.positions of their slots -> [B, dim] float32 residual of each
        row's last token, final norm applied (feed it to `logits`)."""
        return self.last_normed(run_layers(self, self.embed_tokens(tokens), self.step_inputs(index)))

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [B, T] -> [B, T, dim] float32: the residual stream (Gemma's scaled by sqrt(dim))."""
        x = self.embed(tokens)
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def forward_all(self, tokens: Tensor, index: CacheIndex) -> Tensor:
        """`forward` for every position: tokens [B, T] -> [B, T, dim] final-normed residuals
        (prompt scoring: each position's logits score the token after it)."""
        x = run_layers(self, self.embed_tokens(tokens), self.step_inputs(index))
        return F.rms_norm(x, (self.cfg.dim,), self.norm, self.cfg.norm_eps)

    def decode(self, tokens: Tensor, index: CacheIndex, body: Body | None = None) -> HeadOut:
        """One step's rows up to the exact top logits (`exact_top` takes the result): the
        embeddings and inputs, then `body`, a back-end's run of `step.step_body` (None: eager)."""
        x = self.embed_tokens(tokens)
        inputs = self.step_inputs(index)
        return body(x, inputs) if body is not None else step_body(self, x, inputs)  # type: ignore[return-value]

    def step_inputs(self, index: CacheIndex) -> StepInputs:
        """What every layer of the step reads (engine/step.py), made here once a step."""
        cos, sin = self.rope(index.positions)
        extra: dict[str, Tensor] = {}  # what sliding-window (Gemma 3) and recurrent layers read
        if self.window:
            local_cos, local_sin = self.rope_local(index.positions)
            extra = {"local_cos": local_cos, "local_sin": local_sin, "local_mask": index.mask(self.window)}
        # where each row's new entries go and where the positions it attends over are, in the pools
        slots = index.rows[:, 0] + index.lo
        write_at, read_at = self.pool_index(slots, index.positions), self.span_index(slots, index.span)
        # rows gathered from slot 0 on: the whole buffers serve as they are (a compiled step's
        # inputs are those buffers themselves, not views of them)
        whole = index.lo == 0 and not index.sliced
        if self.cfg.recurrent:  # a CUDA graph's padding rows (at ctx, whole buffers) write the spare state row
            extra["state_at"] = torch.where(index.positions[:, 0] < self.ctx, index.rows[:, 0], self.num_slots - index.lo)
        # an eager step's reads, made once for all layers: the view, else the gather's flat index
        # (neither for a decode step whose layers read the pool in place)
        in_place = not index.reading and self.reads_in_place
        view = None if in_place else self.kv_view(index)
        gather = None
        if view is None and index.ends and not in_place:
            gather = gather_index(read_at, self.cfg.n_kv_heads, self.kv_pool_length)
        return StepInputs(index.rows, index.positions, cos, sin, index.mask(), write_at, read_at, **extra, lo=index.lo,
                          hi=None if whole else index.hi, sliced=index.sliced,
                          pieces=index.pieces if index.reading else None, kv_view=view, kv_gather=gather)

    @property
    def kv_pool_length(self) -> int:
        """Positions in each layer's K (and V) pool: its blocks and the spare one."""
        return (self.num_kv_blocks + 1) * self.kv_block

    def rope_local(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The sliding layers' RoPE rows: their own base where the config has one (Gemma 3)."""
        if not self.cfg.local_rope:
            return self.rope(positions)
        return self.cos_local[positions], self.sin_local[positions]

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos, sin [B, T, hd] float32: RoPE is applied in float32 whatever
        the linears' dtype (engine/layers.py Attention)."""
        return self.cos[positions], self.sin[positions]

    def last_normed(self, x: Tensor) -> Tensor:
        """The last layer's output [B, T, dim] -> the final-normed residual of each row's last token."""
        return F.rms_norm(x[:, -1], (self.cfg.dim,), self.norm, self.cfg.norm_eps)

    def head_step(self, x: Tensor) -> HeadOut:
        """The last layer's output [B, T, dim] -> the final-normed rows h, the head's logits and
        the candidates for `exact_top` (`head_logits`): the part of a decode step a compiled step
        can hold (the recomputation's shapes depend on the data)."""
        h = self.last_normed(x)
        return (h, *self.head_logits(h))

    def logits(self, h: Tensor, allowed: Tensor | None = None, scored: Tensor | None = None) -> Tensor:
        """h: [B, dim] float32 (from `forward`) -> logits [B, V] float32 (allowed, scored: `exact_top`'s;
        [2B, V] when a row is scored and the head is a low-precision one).

        A low-precision head is off by up to its `HeadBound` on each logit (int8 weights: up to
        ~0.8 at SmolLM2's logits of 15-30; bf16 rounding of the output alone puts values 1/8
        apart there), so near-ties at the top would be decided by its error, not by the model
        (SmolLM2's "What is the capital of France?": f32 'The' 25.33 vs 'L' 25.24 -> both
        25.125 in bf16 -> 'L'). Every token whose logit could be the maximum within those bounds
        is recomputed in float32 from the file's exact rows: greedy picks what the float32 model
        would, and the top of the distribution is the float32 model's.

        With c the head's logits, Q_n = |x| e_n + (|h - x| + g|x|)(|w_n| + e_n) (see HeadBound)
        and u = 2^-8: the true logit of n lies within Q_n + u|c_n| of c_n. Token n can beat the
        head's top token j only if c_n + Q_n + u|c_n| >= c_j - Q_j - u|c_j|; since c_n <= c_j,
        |c_n| <= |c_j| + c_j - c_n, so it suffices that
            (1 - u) c_n + Q_n >= c_j - Q_j - u (2|c_j| + c_j),
        whose left side is one addmm over the vocabulary."""
        return self.exact_top(h, *self.head_logits(h), allowed, scored)

    def head_logits(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        """h: [B, dim] -> the head's logits [B, V] float32 and, for a low-precision head, the
        tokens whose logit could be the top within its bound ([B, V] bool; see `logits`). Fixed
        shapes, so a compiled step computes them in its graph."""
        x = h.to(torch.bfloat16) if self.head_bound is not None else h
        logits = self.head(x).float()
        if self.head_bound is None or self.head_rows is None:
            return logits, None
        u = HeadBound.ROUNDING
        lhs = torch.addmm(logits, self.head_bound.coefficients(h, x), self.head_bound.table, beta=1 - u)
        top = logits.argmax(dim=-1, keepdim=True)
        c_top, lhs_top = logits.gather(1, top), lhs.gather(1, top)
        q_top = lhs_top - (1 - u) * c_top
        return logits, lhs >= c_top - q_top - u * (2 * c_top.abs() + c_top)

    def exact_top(self, h: Tensor, logits: Tensor, candidates: Tensor | None,
                  allowed: Tensor | None = None, scored: Tensor | None = None) -> Tensor:
        """The candidates' logits recomputed in float32 from the file's exact rows (in place).
        allowed: [B, V] bool, the tokens a constrained row may take (engine/grammar.py; a free row
        all True): the candidates computed around the head's top token could all be forbidden, so
        a constrained row's are computed again around its top *allowed* token, among the allowed.
        scored: [B] bool, the rows that ask for logprobs. When one does and the head is a low-
        precision one, the result is [2B, V]: the B rows every row samples from, then the B rows
        its logprobs report, the scored ones with every logit recomputed (engine/exact_head.py) so
        that their normaliser and top entries are exact too (an exact head's [B, V] are both). A row
        samples from the same logits whether it asks for logprobs or not: asking must not change
        a sampled answer."""
        if candidates is not None and self.head_rows is not None:
            if allowed is not None and self.head_bound is not None:
                candidates = self._candidates_among(h, logits, candidates, allowed)
            rows, cols = candidates.nonzero(as_tuple=True)
            if rows.numel():
                logits[rows, cols] = (h[rows] * self.head_rows(cols)).sum(-1)
            if scored is not None and bool(scored.any()):
                rows = scored.nonzero().squeeze(1)
                logits = torch.cat([logits, logits])
                logits[rows + h.shape[0]] = exact_logits(self.head_rows, h[rows], logits.shape[1])
        return self._softcapped(logits)  # monotonic: the candidates for the top are the same before and after

    def _softcapped(self, logits: Tensor) -> Tensor:
        """cap * tanh(logits / cap) where the config asks (Gemma 3's final_logit_softcapping)."""
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def reported_logits(self, h: Tensor) -> Tensor:
        """h: [B, dim] -> the logits rows that ask for logprobs report ([B, V]: `exact_top`'s
        second half, the scored rows' every logit from the file's exact rows), without the half
        they would sample from: a prompt's scored rows (`echo`) report, and only its last samples."""
        if self.head_bound is None or self.head_rows is None:
            return self.logits(h)
        return self._softcapped(exact_logits(self.head_rows, h, self.cfg.vocab_size))

    def _candidates_among(self, h: Tensor, logits: Tensor, candidates: Tensor, allowed: Tensor) -> Tensor:
        """`head_logits`' bound for the rows that forbid some token, with the top taken among the
        allowed tokens and only those kept (the other rows' candidates unchanged). A row whose
        head top is allowed keeps its candidates among the allowed: every allowed token that could
        beat that top is one of them, so the bound need not be computed again (one addmm less)."""
        assert self.head_bound is not None
        forbids = (~allowed).any(dim=-1)
        top_allowed = allowed.gather(1, logits.argmax(dim=-1, keepdim=True)).squeeze(1)
        candidates = torch.where((forbids & top_allowed).unsqueeze(1), candidates & allowed, candidates)
        rows = (forbids & ~top_allowed).nonzero().squeeze(1)
        if rows.numel() == 0:
            return candidates
        u = HeadBound.ROUNDING
        hr, may = h[rows], allowed[rows]
        c = logits[rows]
        lhs = torch.addmm(c, self.head_bound.coefficients(hr, hr.to(torch.bfloat16)), self.head_bound.table, beta=1 - u)
        top = c.masked_fill(~may, float("-inf")).argmax(dim=-1, keepdim=True)
        c_top, lhs_top = c.gather(1, top), lhs.gather(1, top)
        q_top = lhs_top - (1 - u) * c_top
        candidates[rows] = (lhs >= c_top - q_top - u * (2 * c_top.abs() + c_top)) & may
        return candidates


def rows_on(device: torch.device, source: WeightSource, name: str) -> RowTable:
    """The source's row table, unless it needs engine/quants' CPU op on another device (CUDA: the
    dense rows, as before those types were kept as blocks)."""
    rows = source.rows(name)
    if device.type != "cpu" and isinstance(rows, QuantRows):
        return DenseRows(source.dense(name))
    return rows

