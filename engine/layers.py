"""A decoder layer and its parts, chosen per layer when the model is built.

`Block` is the residual frame: norm -> mixer -> add, norm -> FFN -> add. The mixer is what mixes
tokens across positions and owns the layer's per-slot state: `Attention` (K/V buffers) today; a
sliding-window layer is an `Attention` with a `window`, which reads the step's sliding-window
mask and local RoPE rows (Gemma 3), and a recurrent layer is another mixer with its own state
buffers beside the attention layers' K/V (Qwen3-Next's `engine.deltanet.GatedDeltaNet`). The
FFN is `GatedFFN` (SwiGLU, or Gemma's GELU) or the experts of an MoE layer (`engine.moe.Experts`,
set by `Transformer.build`). Every layer runs on the step's `StepInputs` (engine/step.py), built
once a step, and on its own state as the step sees it, so the one layer loop (`step.run_layers`)
serves eager, compiled, exported and CUDA-graphed running alike.

A mixer declares its state in `STATE`: each buffer's attribute name and which of its dims follow
the slot count ("slots", dim 0 of a buffer kept per slot) or the pool's size ("tokens": the K/V
blocks all slots share), so a compiled step keeps those sizes dynamic and `allocate` makes them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import kv_dtype
from engine.quants.build import load
from engine.step import StepInputs
from engine.weights import in_pieces


IN_PLACE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)  # the pools engine/attend.cpp reads


class Attention(nn.Module):
    """Grouped-query attention with RoPE (and Qwen3's q/k norms), over a K and a V pool per layer:
    [n_kv_heads, pool positions, head_dim] each, the blocks every slot's table points into
    (engine/model.py `allocate_cache`)."""

    STATE: ClassVar[dict[str, dict[int, str]]] = {"k_cache": {1: "tokens"}, "v_cache": {1: "tokens"}}

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float, *, window: int = 0,
                 scale: float = 0.0, gated: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.norm_eps = n_heads, n_kv_heads, head_dim, norm_eps
        self.window = window  # > 0: attends over the last `window` positions (StepInputs.local_*)
        self.scale = scale  # the scores' factor; 0: head_dim ** -0.5
        # Qwen3-Next: the output times sigmoid(gate), a gate per query element (wqkv's last rows)
        self.gated = gated
        # Filled by Transformer.build (linears: engine/weights.py) and `allocate`.
        self.q_norm: Tensor | None = None
        self.k_norm: Tensor | None = None
        self.wqkv: nn.Module = nn.Identity()
        self.wo: nn.Module = nn.Identity()
        self.k_cache = self.v_cache = torch.empty(0)
        # a decode step's attention reads the pool in place (engine/attend.cpp), set by `allocate`
        self.in_place = False

    def allocate(self, num_tokens: int, device: torch.device, dtype: torch.dtype, spare: int, num_slots: int) -> None:
        # `spare` positions past the pool's: what no slot was given (padding rows write there, an
        # unassigned table entry reads there, masked); zeros, so a masked read is finite.
        # an entry per (head, position): the head's values, and an int8/fp8 pool's scale (engine/kv_dtype.py)
        shape = (self.n_kv_heads, num_tokens + spare, kv_dtype.entry_width(self.head_dim, dtype))
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        # On the CPU a decode step reads each row's positions where they lie (1.5-2.5x faster than
        # gathering them first, docs/kv_pool.md); CUDA, an fp8 pool, or no C++ compiler: gathered.
        self.in_place = device.type == "cpu" and dtype in IN_PLACE_DTYPES and load("strata_attend") is None

    def forward(self, h: Tensor, inputs: StepInputs, state: tuple[Tensor, ...]) -> Tensor:
        """h: [B, T, dim] normed residual; state: this layer's K/V pools [KV, N, hd], written at
        inputs.write_at, each row's span of positions read from inputs.read_at -> [B, T, dim] in
        the output linear's dtype."""
        keys, values = state
        bsz, seq, _ = h.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        # float32 from the linear's output on: q/k norms, RoPE and the (float32) cache then add no
        # bf16 rounding of their own beside the linear's (docs/engine.md, "Precision per instruction set")
        sizes = (q_size, kv_size, kv_size, q_size) if self.gated else (q_size, kv_size, kv_size)
        q, k, v, *gate = in_pieces(self.wqkv, h, inputs.pieces).float().split(sizes, dim=-1)
        q = q.view(bsz, seq, self.n_heads, self.head_dim)
        k = k.view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, seq, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = F.rms_norm(q, (self.head_dim,), self.q_norm, self.norm_eps)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm, self.norm_eps)
        cos, sin, mask = inputs.attention(sliding=self.window > 0)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        # One index-put per pool: [KV, B, T, hd] at the rows' places (write_at [B, T]).
        keys[:, inputs.write_at] = kv_dtype.store(k.permute(2, 0, 1, 3), keys.dtype)
        values[:, inputs.write_at] = kv_dtype.store(v.permute(2, 0, 1, 3), values.dtype)
        # Each row's positions 0..span-1 as the [B, KV, span, hd] rows attention reads: a strided
        # view of the pool where the rows' blocks are runs (an eager decode, `inputs.kv_view`), else
        # gathered through the block tables (docs/kv_pool.md weighs it against flex_attention's paged
        # mask). The gather: index_select on the flattened pool with one index per (row, head,
        # position), ~5-7x faster in eager than advanced indexing `keys[heads, read_at]`.
        span = inputs.read_at.shape[1]
        if self.in_place and inputs.pieces is None:
            out = torch.ops.strata_attend.decode(q, keys, values, inputs.read_at, mask.view(bsz, seq, span),
                                                 self.scale or self.head_dim**-0.5)
            return self._out(out, gate, inputs)
        keys = kv_dtype.load(self._rows(keys, inputs, bsz, span), self.head_dim)
        values = kv_dtype.load(self._rows(values, inputs, bsz, span), self.head_dim)
        attention = attend_plain if inputs.pieces is None else attend_prompt
        out = attention(q.transpose(1, 2), keys, values, mask, self.scale)
        return self._out(out, gate, inputs)

    def _out(self, out: Tensor, gate: list[Tensor], inputs: StepInputs) -> Tensor:
        if gate:
            out = out * torch.sigmoid(gate[0])
        return in_pieces(self.wo, out, inputs.pieces)

    def _rows(self, pool: Tensor, inputs: StepInputs, bsz: int, span: int) -> Tensor:
        """pool [KV, N, width] -> [B, KV, span, width]: each row's first span positions."""
        width = pool.shape[-1]
        if inputs.kv_view is not None:
            start, stride = inputs.kv_view
            return pool.as_strided((bsz, self.n_kv_heads, span, width),
                                   (stride * pool.stride(1), pool.stride(0), pool.stride(1), pool.stride(2)),
                                   pool.storage_offset() + start * pool.stride(1))
        at = inputs.kv_gather
        if at is None:  # a compiled step's: its graph makes (and fuses) its own
            at = gather_index(inputs.read_at, self.n_kv_heads, pool.shape[1])
        return pool.view(-1, width).index_select(0, at).view(bsz, self.n_kv_heads, span, width)


def gather_index(read_at: Tensor, n_kv_heads: int, pool_length: int) -> Tensor:
    """read_at [B, span] (each row's positions' places in a pool) -> [B * KV * span]: their places
    in the pool [KV, pool_length, width] flattened over its heads, for one index_select."""
    heads = torch.arange(n_kv_heads, device=read_at.device).view(1, -1, 1) * pool_length
    return (read_at.unsqueeze(1) + heads).reshape(-1)


class GatedFFN(nn.Module):
    """down(act(gate(h)) * up(h)), gate and up fused into one matrix; act: "silu" (SwiGLU) or
    "gelu_tanh" (Gemma)."""

    def __init__(self, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        self.w_gate_up: nn.Module = nn.Identity()
        self.w_down: nn.Module = nn.Identity()

    def forward(self, h: Tensor, pieces: tuple[int, ...] | None = None) -> Tensor:
        # act(gate) * up in float32, rounded once where the down linear takes it
        gate, up = in_pieces(self.w_gate_up, h, pieces).float().chunk(2, dim=-1)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return in_pieces(self.w_down, act * up, pieces)


class Block(nn.Module):
    """One layer: x + mixer(norm(x)), then + ffn(norm(x)); the residual stays float32. Gemma 3
    also norms each part's output (`post_attn_norm`, `post_ffn_norm`)."""

    def __init__(self, dim: int, norm_eps: float, mixer: nn.Module, ffn: nn.Module) -> None:
        super().__init__()
        self.dim, self.norm_eps = dim, norm_eps
        self.attn_norm = self.ffn_norm = torch.empty(0)  # float32, like the residual (Transformer.build)
        self.post_attn_norm: Tensor | None = None
        self.post_ffn_norm: Tensor | None = None
        self.mixer = mixer
        self.ffn = ffn

    def state(self) -> tuple[Tensor, ...]:
        """The mixer's per-slot buffers, in its STATE order."""
        return tuple(getattr(self.mixer, name) for name in self.mixer.STATE)

    def allocate(self, num_tokens: int, device: torch.device, dtype: torch.dtype, spare: int, num_slots: int) -> None:
        self.mixer.allocate(num_tokens, device, dtype, spare, num_slots)

    def forward(self, x: Tensor, inputs: StepInputs, state: tuple[Tensor, ...]) -> Tensor:
        """x: [B, T, dim] float32 residual -> [B, T, dim]."""
        h = F.rms_norm(x, (self.dim,), self.attn_norm, self.norm_eps)
        out = self.mixer(h, inputs, state)
        if self.post_attn_norm is not None:
            out = F.rms_norm(out.float(), (self.dim,), self.post_attn_norm, self.norm_eps)
        x = x + out
        h = F.rms_norm(x, (self.dim,), self.ffn_norm, self.norm_eps)
        out = self.ffn(h, inputs.pieces)
        if self.post_ffn_norm is not None:
            out = F.rms_norm(out.float(), (self.dim,), self.post_ffn_norm, self.norm_eps)
        return x + out  # float32 x + bf16 promotes to float32


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., hd] rotated by RoPE rows of the first cos.shape[-1] dims (all of them, or
    Qwen3-Next's partial RoPE: a quarter of each head), the rest passed through."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat([head * cos + rotate_half(head) * sin, rest], dim=-1)


def rotate_half(x: Tensor) -> Tensor:
    # HF RoPE layout: the first half of head_dim pairs with the second half.
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend_prompt(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float = 0.0) -> Tensor:
    """Float32 attention of prompt tokens (any number, one too). q: [B, H, T, hd]; keys, values:
    [B, KV, L, hd]; mask: [B, 1, 1, T, L] bool -> [B, T, H*hd] in q's dtype. scale: the scores'
    factor (0: head_dim ** -0.5).

    torch's fused kernel, in float32, which never holds the [T, L] scores whole: 2.3x faster than
    the plain path at 256 queries over 2 000 keys, 4.6x at 512, the same error against float64.
    Its bf16-rounded outputs differ from the plain path's in a few elements, which moves greedy
    near-ties downstream (docs/engine.md, "Beside llama.cpp"), so a prompt token goes through it
    whatever its chunk's length (a read), and a generated one never."""
    bsz, n_heads, seq, head_dim = q.shape
    out = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask.view(bsz, 1, seq, -1),
                                         enable_gqa=True, scale=scale or None)
    return out.to(q.dtype).transpose(1, 2).reshape(bsz, seq, n_heads * head_dim)


def attend_plain(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float = 0.0) -> Tensor:
    """Float32 attention of generated tokens (a decode step: one query per row): matmul ->
    softmax -> matmul (SDPA with one query was ~4x slower in bf16); shapes as `attend_prompt`."""
    bsz, n_heads, seq, head_dim = q.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    # Query head h reads kv head h // group, so grouping heads under their kv head needs no copy.
    qg = q.reshape(bsz, n_kv, group * seq, head_dim)
    # Scores, softmax and the weighted sum in float32 (bf16 scores are 1/8-1/4 apart at 16-64).
    qg = qg.float()
    scores = _per_head_matmul(qg, keys.float().transpose(-1, -2)) * (scale or head_dim**-0.5)  # [B, KV, G*T, L]
    scores = scores.view(bsz, n_kv, group, seq, -1).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(bsz, n_kv, group * seq, -1)
    out = _per_head_matmul(probs, values.float()).to(q.dtype)  # [B, KV, G*T, hd]
    return out.view(bsz, n_heads, seq, head_dim).transpose(1, 2).reshape(bsz, seq, n_heads * head_dim)


def _per_head_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a [B, KV, m, k] @ b [B, KV, k, n]. One batched matmul where b's rows and heads fold into
    one batch dim (gathered rows, or one row); a view of the pool (Attention._rows) does not fold,
    and matmul would copy it whole, so there it is one matmul per KV head, each over the rows:
    the same [m, k] @ [k, n] products with the same layout, the same bits (tests/engine/test_kv_pool.py)."""
    # (the strides first: in a compiled step's gathered rows that test is true for any batch size)
    if b.stride(0) == b.shape[1] * b.stride(1) or b.shape[0] == 1:
        return torch.matmul(a, b)
    return torch.stack([torch.matmul(a[:, h], b[:, h]) for h in range(b.shape[1])], dim=1)
