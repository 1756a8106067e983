"""Qwen3-Next's Gated DeltaNet: a linear-attention mixer whose memory of the past is a fixed-size
state per slot instead of K/V entries per position.

Per slot and layer the state is two buffers: the last `kernel - 1` inputs of the short causal
convolution over q/k/v (`conv`, [conv_dim, kernel - 1]) and the recurrent matrix of each value
head (`recurrent`, [Hv, dk, dv], float32). A token t updates it (the gated delta rule):

    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

with q, k l2-normalized (q also by 1/sqrt(dk)), beta = sigmoid(b), g = -exp(A_log) softplus(a +
dt_bias); the output is RMS-normed per head, times silu(z), then projected. Tokens are read in
order, one after another (a chunk's tokens in a loop): the state after a chunk is exactly the
state before it advanced by its tokens, so a prompt read in chunks gives what one read gives.

What the state cannot do is go back: a slot's recurrent state is valid at one position only, the
number of tokens it has read. So a slot may keep a prefix (reuse its cache for a new request) only
at exactly that position, and a step may not be undone (a wrong prompt-lookup guess rewinds the
K/V cache by hiding entries; a recurrent state would keep the rejected token): see
docs/engine.md, "Known gaps".

`DeltaNetWeights` is the layer's weights in HF layout (transformers' Qwen3NextGatedDeltaNet,
whose in_proj_qkvz interleaves q, k, v, z per key-head group: `split_qkvz` undoes that);
`delta_step` runs T tokens of B rows from their states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class DeltaNetShape:
    n_k_heads: int
    n_v_heads: int
    k_dim: int  # per head
    v_dim: int  # per head
    kernel: int  # the convolution's width

    @property
    def key_size(self) -> int:
        return self.n_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.n_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_size + self.value_size


@dataclass
class DeltaNetWeights:
    qkvz: Tensor  # [2 key_size + 2 value_size, dim], transformers' interleaved order
    ba: Tensor  # [2 Hv, dim], interleaved likewise
    conv: Tensor  # [conv_dim, kernel]
    dt_bias: Tensor  # [Hv]
    a_log: Tensor  # [Hv]
    norm: Tensor  # [v_dim] (a plain RMSNorm weight, not 1 + w)
    out: Tensor  # [dim, value_size]


def split_qkvz(mixed: Tensor, ba: Tensor, shape: DeltaNetShape) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """mixed [N, 2 key_size + 2 value_size], ba [N, 2 Hv] (grouped per key head, as
    transformers' fix_query_key_value_ordering reads them) -> q, k [N, key_size], v, z [N,
    value_size], b, a [N, Hv]."""
    n = mixed.shape[0]
    per = shape.n_v_heads // shape.n_k_heads
    q, k, v, z = mixed.view(n, shape.n_k_heads, -1).split(
        (shape.k_dim, shape.k_dim, per * shape.v_dim, per * shape.v_dim), dim=-1)
    b, a = ba.view(n, shape.n_k_heads, 2 * per).split((per, per), dim=-1)
    return (q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1), z.reshape(n, -1),
            b.reshape(n, -1), a.reshape(n, -1))


def delta_step(h: Tensor, w: DeltaNetWeights, shape: DeltaNetShape, conv_state: Tensor,
               recurrent: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """h: [B, T, dim] normed input; conv_state [B, conv_dim, kernel - 1]; recurrent [B, Hv, dk, dv]
    float32 -> (out [B, T, dim] float32, the new conv state, the new recurrent state)."""
    bsz, seq, _ = h.shape
    flat = h.reshape(bsz * seq, -1).float()
    q, k, v, z, b, a = split_qkvz(flat @ w.qkvz.float().T, flat @ w.ba.float().T, shape)
    mixed = torch.cat([q, k, v], dim=-1).view(bsz, seq, -1).transpose(1, 2)  # [B, conv_dim, T]
    padded = torch.cat([conv_state.float(), mixed], dim=-1)
    conv = F.silu(F.conv1d(padded, w.conv.float().unsqueeze(1), groups=shape.conv_dim))  # [B, conv_dim, T]
    new_conv = padded[:, :, -(shape.kernel - 1):]
    q, k, v = conv.transpose(1, 2).split((shape.key_size, shape.key_size, shape.value_size), dim=-1)
    per = shape.n_v_heads // shape.n_k_heads
    q = _l2(q.reshape(bsz, seq, shape.n_k_heads, shape.k_dim))
    k = _l2(k.reshape(bsz, seq, shape.n_k_heads, shape.k_dim))
    q = q.repeat_interleave(per, dim=2) * shape.k_dim ** -0.5
    k = k.repeat_interleave(per, dim=2)
    v = v.reshape(bsz, seq, shape.n_v_heads, shape.v_dim)
    beta = torch.sigmoid(b).view(bsz, seq, -1)
    g = (-w.a_log.float().exp() * F.softplus(a.view(bsz, seq, -1) + w.dt_bias.float()))
    state = recurrent.float()
    outs = []
    for t in range(seq):
        state = state * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        memory = (state * kt.unsqueeze(-1)).sum(dim=-2)  # [B, Hv, dv]
        delta = (v[:, t] - memory) * beta[:, t].unsqueeze(-1)
        state = state + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(dim=-2))
    out = torch.stack(outs, dim=1)  # [B, T, Hv, dv]
    out = F.rms_norm(out, (shape.v_dim,), w.norm.float(), eps) * F.silu(z.view(bsz, seq, shape.n_v_heads, shape.v_dim))
    return out.reshape(bsz, seq, -1) @ w.out.float().T, new_conv, state


def _l2(x: Tensor) -> Tensor:
    """transformers' (and FLA's) l2norm: x / sqrt(sum x^2 + 1e-6)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
