"""A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3 shapes) with a KV cache per slot.

Two entry points, both under the caller's `torch.inference_mode()`:
- `prefill(slot, tokens, start)`: a chunk of one slot's prompt; logits for its last position only.
- `decode(slots, tokens, positions)`: one token for each of B slots, each at its own position.

Weights come in already in this model's layout (the loaders undo file-format quirks) under the
names listed in `WEIGHT_NAMES`; `Transformer.from_weights` fuses q/k/v and gate/up into single
matrices, since at batch 1 every extra op is Python overhead that dominates the step.
`Transformer.attach_int4` (opt-in, CPU) adds int4 copies of those linears, built from a GGUF's
Q4_0/Q4_1 blocks, for decode steps of at most INT4_MAX_ROWS rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Per-layer weight names the loaders produce (prefix "layers.{i}."); optional ones may be absent.
WEIGHT_NAMES = (
    "attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down",  # always
    "q_bias", "k_bias", "v_bias", "q_norm", "k_norm",  # Qwen2 biases, Qwen3 q/k norms
)
# Whole-model names: "embed", "norm", and "output" unless the embeddings are tied.

# Decode attends over the cache sliced to the longest active row, rounded up to this, so the
# shapes (and any future compiled graph) change only every BUCKET tokens.
KV_BUCKET = 256

# Decode steps of at most this many rows use the int4 copies of the linears when attached
# (Transformer.attach_int4); larger steps and prefill use the dense weights.
INT4_MAX_ROWS = 8


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

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.attn_norm = nn.Parameter(torch.ones(cfg.dim), requires_grad=False)
        self.ffn_norm = nn.Parameter(torch.ones(cfg.dim), requires_grad=False)
        self.wqkv = nn.Linear(cfg.dim, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_size, cfg.dim, bias=False)
        self.w_gate_up = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)
        self.w_down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim), requires_grad=False)
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim), requires_grad=False)
        # Activations entering the linears are in the weights' dtype; the residual stream and the
        # RMSNorm weights stay float32 (set by Transformer.from_weights).
        self.act_dtype = torch.float32
        # Filled by Transformer.allocate_cache: [num_slots, n_kv_heads, ctx, head_dim] each.
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        # Int4 copies of wqkv, wo, w_gate_up, w_down (Transformer.attach_int4), or None.
        self.int4: dict[str, Int4Linear] | None = None

    def linear(self, name: str, x: Tensor, int4: bool) -> Tensor:
        if int4 and self.int4 is not None:
            return self.int4[name](x)
        return getattr(self, name)(x)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor, int4: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        # x: [B, T, dim]; cos, sin: [B, T, head_dim] -> q [B, H, T, hd], k and v [B, KV, T, hd]
        cfg = self.cfg
        bsz, seq, _ = x.shape
        h = F.rms_norm(x, (cfg.dim,), self.attn_norm, cfg.norm_eps).to(self.act_dtype)  # x: float32
        q, k, v = self.linear("wqkv", h, int4).split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        q = q.view(bsz, seq, cfg.n_heads, cfg.head_dim)
        k = k.view(bsz, seq, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(bsz, seq, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = F.rms_norm(q, (cfg.head_dim,), self.q_norm, cfg.norm_eps)
            k = F.rms_norm(k, (cfg.head_dim,), self.k_norm, cfg.norm_eps)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def mlp(self, x: Tensor, int4: bool = False) -> Tensor:
        # x: [B, T, dim] -> [B, T, dim], residual included
        h = F.rms_norm(x, (self.cfg.dim,), self.ffn_norm, self.cfg.norm_eps).to(self.act_dtype)
        gate, up = self.linear("w_gate_up", h, int4).chunk(2, dim=-1)  # x stays float32: x + bf16 promotes
        return x + self.linear("w_down", F.silu(gate) * up, int4)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.dim), requires_grad=False)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.cos: Tensor | None = None
        self.sin: Tensor | None = None
        self.num_slots = 0
        self.ctx = 0

    # ---- set-up ---------------------------------------------------------------------------

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: dict[str, Tensor], *, dtype: torch.dtype, device: torch.device
    ) -> "Transformer":
        """Build from loader names (see WEIGHT_NAMES); fuses q/k/v and gate/up once, here."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        model.requires_grad_(False)

        def take(name: str) -> Tensor:
            return weights[name].to(device=device, dtype=dtype)

        model.embed.weight.copy_(take("embed"))
        model.norm.copy_(take("norm"))
        # The residual stream is float32 whatever the weights' dtype (see docs/engine.md,
        # "bf16 precision"): the final and per-block RMSNorm weights live in float32 with it.
        model.norm.data = model.norm.data.float()
        if cfg.tie_embeddings or "output" not in weights:
            model.output.weight = model.embed.weight
        else:
            model.output.weight.copy_(take("output"))
        for i, block in enumerate(model.layers):
            p = f"layers.{i}."
            block.attn_norm.copy_(take(p + "attn_norm"))
            block.ffn_norm.copy_(take(p + "ffn_norm"))
            block.attn_norm.data = block.attn_norm.data.float()
            block.ffn_norm.data = block.ffn_norm.data.float()
            block.act_dtype = dtype
            block.wqkv.weight.copy_(torch.cat([take(p + "q"), take(p + "k"), take(p + "v")]))
            if cfg.qkv_bias:
                block.wqkv.bias.copy_(torch.cat([take(p + "q_bias"), take(p + "k_bias"), take(p + "v_bias")]))
            block.wo.weight.copy_(take(p + "o"))
            block.w_gate_up.weight.copy_(torch.cat([take(p + "gate"), take(p + "up")]))
            block.w_down.weight.copy_(take(p + "down"))
            if cfg.qk_norm:
                block.q_norm.copy_(take(p + "q_norm"))
                block.k_norm.copy_(take(p + "k_norm"))
        model.head_weight = model.output.weight  # plain rows for `logits` (kept if prepacked)
        return model.eval()

    def prepack_cpu_bf16(self) -> bool:
        """Swap every Linear for one whose bf16 weight is reordered once into oneDNN's blocked
        layout: the same products bit for bit, but ~1.5x faster at 1-4 rows than plain F.linear,
        which re-reads the weight in its plain layout each step. Returns False if unavailable."""
        if self.embed.weight.device.type != "cpu" or self.embed.weight.dtype != torch.bfloat16:
            return False
        if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            return False
        for block in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                setattr(block, name, PackedLinear(getattr(block, name)))
        self.output = PackedLinear(self.output)  # a packed copy; the embedding keeps the plain one
        return True

    def attach_int4(self, blocks: dict[str, Int4Blocks]) -> bool:
        """Add int4 copies of every attention/MLP linear, built from a file's 4-bit blocks (see
        `Int4Blocks`; loader names, HF row order), for decode steps of <= INT4_MAX_ROWS rows. The
        dense weights stay for prefill and larger steps; embedding and output head stay dense.
        CPU only (torch.ops.aten._weight_int4pack_mm_for_cpu); returns False where unavailable."""
        if self.embed.weight.device.type != "cpu" or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return False

        def fused(*names: str) -> Int4Blocks:
            return Int4Blocks(*(torch.cat(parts) for parts in zip(*(blocks[n] for n in names))))

        for i, block in enumerate(self.layers):
            p = f"layers.{i}."
            block.int4 = {
                "wqkv": Int4Linear(fused(p + "q", p + "k", p + "v"), block.wqkv.bias),
                "wo": Int4Linear(blocks[p + "o"]),
                "w_gate_up": Int4Linear(fused(p + "gate", p + "up")),
                "w_down": Int4Linear(blocks[p + "down"]),
            }
        return True

    def allocate_cache(self, num_slots: int, ctx: int) -> None:
        """One K and one V buffer per layer (a single shared buffer made writes copy it whole)."""
        cfg = self.cfg
        device, dtype = self.embed.weight.device, self.embed.weight.dtype
        shape = (num_slots, cfg.n_kv_heads, ctx, cfg.head_dim)
        for block in self.layers:
            block.k_cache = torch.zeros(shape, device=device, dtype=dtype)
            block.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        angles = torch.outer(torch.arange(ctx, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # HF layout: the two halves share frequencies
        # Tables in float32 (angles past a few hundred lose their low bits in bf16); each step
        # rounds the rows it uses to the model dtype, as transformers does.
        self.cos = angles.cos().to(device=device, dtype=torch.float32)
        self.sin = angles.sin().to(device=device, dtype=torch.float32)
        self.num_slots, self.ctx = num_slots, ctx

    # ---- forward --------------------------------------------------------------------------

    def prefill(self, slot: int, tokens: Tensor, start: int, need_logits: bool = True) -> Tensor | None:
        """tokens: [T] at positions [start, start+T) of `slot` -> logits [V] (float32) of the last
        position, or None when need_logits is False (a middle chunk of a prompt)."""
        seq = tokens.shape[0]
        end = start + seq
        dtype = self.embed.weight.dtype
        x = self.embed(tokens).unsqueeze(0).float()  # [1, T, dim], the residual stream in float32
        cos = self.cos[start:end].to(dtype).unsqueeze(0)  # [1, T, hd]
        sin = self.sin[start:end].to(dtype).unsqueeze(0)
        # Causal inside the chunk, everything before it visible: key j is seen by row i iff j <= start+i.
        rows = torch.arange(start, end, device=tokens.device).unsqueeze(1)
        cols = torch.arange(end, device=tokens.device).unsqueeze(0)
        mask = (cols <= rows).view(1, 1, 1, seq, end)  # [1, 1, 1, T, L]
        for block in self.layers:
            q, k, v = block.qkv(x, cos, sin)  # q [1, H, T, hd]; k, v [1, KV, T, hd]
            block.k_cache[slot, :, start:end] = k[0]
            block.v_cache[slot, :, start:end] = v[0]
            keys = block.k_cache[slot : slot + 1, :, :end]  # [1, KV, L, hd], a view
            values = block.v_cache[slot : slot + 1, :, :end]
            x = x + block.wo(attend(q, keys, values, mask))
            x = block.mlp(x)
        if not need_logits:
            return None
        return self.logits(x[:, -1])[0]

    def decode(self, slots: Tensor, tokens: Tensor, positions: Tensor, span: int, slot_range: tuple[int, int] | None) -> Tensor:
        """One step for B slots.
        slots, tokens, positions: [B] (long) -> logits [B, V] (float32).
        span: keys to attend to (>= max(positions)+1, bucketed by the caller).
        slot_range: (lo, hi) when slots == lo..hi-1 in order, so the cache is sliced, not gathered."""
        bsz = tokens.shape[0]
        dtype = self.embed.weight.dtype
        x = self.embed(tokens).unsqueeze(1).float()  # [B, 1, dim], the residual stream in float32
        cos = self.cos[positions].to(dtype).unsqueeze(1)  # [B, 1, hd]
        sin = self.sin[positions].to(dtype).unsqueeze(1)
        cols = torch.arange(span, device=tokens.device)
        mask = (cols.unsqueeze(0) <= positions.unsqueeze(1)).view(bsz, 1, 1, 1, span)  # [B, 1, 1, 1, L]
        int4 = bsz <= INT4_MAX_ROWS  # used only by blocks with int4 copies attached
        for block in self.layers:
            q, k, v = block.qkv(x, cos, sin, int4)  # q [B, H, 1, hd]; k, v [B, KV, 1, hd]
            block.k_cache[slots, :, positions] = k[:, :, 0]  # one index-put per buffer
            block.v_cache[slots, :, positions] = v[:, :, 0]
            if slot_range is not None:
                keys = block.k_cache[slot_range[0] : slot_range[1], :, :span]  # [B, KV, L, hd], a view
                values = block.v_cache[slot_range[0] : slot_range[1], :, :span]
            else:
                keys = block.k_cache[slots, :, :span]  # scattered slots: a gather (copy)
                values = block.v_cache[slots, :, :span]
            x = x + block.linear("wo", attend(q, keys, values, mask), int4)
            x = block.mlp(x, int4)
        return self.logits(x[:, 0])

    def logits(self, x: Tensor) -> Tensor:
        """x: [B, dim] float32 residual -> logits [B, V] float32.

        In bf16 the head's output is rounded to bf16: 1/8 apart at logits of 16-32, so near-ties
        at the top collapse into exact ties that argmax breaks by token id (SmolLM2's "What is the
        capital of France?": f32 'The' 25.33 vs 'L' 25.24 -> both 25.125 -> 'L'). The true
        float32-accumulated value is within half a bf16 step of the rounded one, so every token
        within one step of the maximum is recomputed exactly: greedy picks as a float32-output
        head would, at the cost of a few dot products."""
        dtype = self.head_weight.dtype
        h = F.rms_norm(x, (self.cfg.dim,), self.norm, self.cfg.norm_eps).to(dtype)  # [B, dim]
        logits = self.output(h).float()
        if dtype == torch.float32:
            return logits
        top = logits.max(dim=-1, keepdim=True).values
        step = torch.exp2(torch.floor(torch.log2(top.abs().clamp_min(1e-30))) - 7)  # bf16 ulp at top
        rows, cols = (logits >= top - 2 * step).nonzero(as_tuple=True)
        logits[rows, cols] = (h[rows].float() * self.head_weight[cols].float()).sum(-1)
        return logits


class PackedLinear(nn.Module):
    """F.linear with the weight prepacked by oneDNN (CPU, bf16)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int4Blocks(NamedTuple):
    """A matrix as 4-bit groups of 32 along its input dim: w[r, c] = q[r, c] * scale[r, c // 32]
    + offset[r, c // 32]. q: uint8 [out, in] in 0..15; scale, offset: float32 [out, in // 32]."""

    q: Tensor
    scale: Tensor
    offset: Tensor


class Int4Linear(nn.Module):
    """F.linear with int4 weights via torch.ops.aten._weight_int4pack_mm_for_cpu (CPU).

    That op computes w = (q - 8) * s + z per group, so s = scale, z = offset + 8 * scale. It takes
    float32 activations too, but there it was ~50x slower than in bf16 (no vectorized kernel), so
    activations are cast to bf16 in and the bf16 output back to the input's dtype; the op wants s
    and z in the activations' dtype, so they are rounded to bf16 (relative error <= 2^-9, like a
    bf16 copy of the dequantized weight). Bias, if any, is added in the input's dtype."""

    def __init__(self, blocks: Int4Blocks, bias: Tensor | None = None) -> None:
        super().__init__()
        q, scale, offset = blocks
        self.out_features, in_features = q.shape
        self.group = in_features // scale.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        zero = offset.float() + 8 * scale.float()
        self.scale_zeros = torch.stack([scale.float(), zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.packed, self.group, self.scale_zeros
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def rotate_half(x: Tensor) -> Tensor:
    # HF RoPE layout: the first half of head_dim pairs with the second half.
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Plain matmul -> float32 softmax -> matmul (SDPA with one query was ~4x slower in bf16).
    q: [B, H, T, hd]; keys, values: [B, KV, L, hd]; mask: [B, 1, 1, T, L] bool -> [B, T, H*hd]."""
    bsz, n_heads, seq, head_dim = q.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    # Query head h reads kv head h // group, so grouping heads under their kv head needs no copy.
    qg = q.reshape(bsz, n_kv, group * seq, head_dim)
    # Scores, softmax and the weighted sum in float32 (bf16 scores are 1/8-1/4 apart at 16-64).
    qg = qg.float()
    scores = torch.matmul(qg, keys.float().transpose(-1, -2)) * (head_dim**-0.5)  # [B, KV, G*T, L]
    scores = scores.view(bsz, n_kv, group, seq, -1).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(bsz, n_kv, group * seq, -1)
    out = torch.matmul(probs, values.float()).to(q.dtype)  # [B, KV, G*T, hd]
    return out.view(bsz, n_heads, seq, head_dim).transpose(1, 2).reshape(bsz, seq, n_heads * head_dim)
