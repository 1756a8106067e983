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
docs/engine.md, "Recurrent state (Qwen3-Next)".

`GatedDeltaNet` is the mixer a linear-attention layer of the step runs (engine/layers.py's frame):
its input projection is one matrix in the order the convolution reads (q, k, v of every head,
then z, then b and a: `deinterleave` turns transformers' per-key-head interleaving, which the
legacy GGUF `ssm_in`/`ssm_ba` keep too, into it), its state two buffers per slot plus a spare row
(what a CUDA graph's padding rows write: `StepInputs.state_at`). A row whose first position is 0
starts from zeros, so a slot needs no reset between requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.weights import in_pieces

if TYPE_CHECKING:
    from engine.step import StepInputs


@dataclass(frozen=True)
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

    @property
    def in_size(self) -> int:
        """Rows of the fused input projection: q, k, v, z, b, a."""
        return self.conv_dim + self.value_size + 2 * self.n_v_heads

    def state_bytes(self) -> int:
        """One slot's conv and recurrent state, float32."""
        return 4 * (self.conv_dim * (self.kernel - 1) + self.n_v_heads * self.k_dim * self.v_dim)


def deinterleave(qkvz: Tensor, ba: Tensor, shape: DeltaNetShape) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """transformers' in_proj_qkvz [2 key_size + 2 value_size, dim] and in_proj_ba [2 Hv, dim],
    grouped per key head (as its fix_query_key_value_ordering reads them) -> qkv [conv_dim, dim]
    (every head's q, then k, then v), z [value_size, dim], b and a [Hv, dim]."""
    dim = qkvz.shape[-1]
    per = shape.n_v_heads // shape.n_k_heads
    q, k, v, z = qkvz.reshape(shape.n_k_heads, -1, dim).split(
        (shape.k_dim, shape.k_dim, per * shape.v_dim, per * shape.v_dim), dim=1)
    qkv = torch.cat([q.reshape(-1, dim), k.reshape(-1, dim), v.reshape(-1, dim)])
    return (qkv, z.reshape(-1, dim), *split_ba(ba, shape))


def split_ba(ba: Tensor, shape: DeltaNetShape) -> tuple[Tensor, Tensor]:
    """in_proj_ba [2 Hv, dim] (per key head: its value heads' b, then their a; llama.cpp's ssm_ba
    in either layout) -> b, a [Hv, dim]."""
    per = shape.n_v_heads // shape.n_k_heads
    b, a = ba.reshape(shape.n_k_heads, 2 * per, -1).split((per, per), dim=1)
    return b.reshape(shape.n_v_heads, -1), a.reshape(shape.n_v_heads, -1)


def delta_step(projected: Tensor, conv_weight: Tensor, dt_bias: Tensor, a_neg: Tensor, norm: Tensor,
               shape: DeltaNetShape, conv_state: Tensor, recurrent: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """projected: [B, T, in_size] the input projection's output; conv_weight [conv_dim, kernel];
    dt_bias, a_neg (= -exp(A_log)) [Hv]; norm [v_dim] (a plain RMSNorm weight); conv_state [B, conv_dim, kernel -
    1], recurrent [B, Hv, dk, dv] float32 -> (the gated, normed output [B, T, value_size] float32
    before the output projection, the new conv state, the new recurrent state)."""
    bsz, seq, _ = projected.shape
    mixed, z, b, a = projected.float().split((shape.conv_dim, shape.value_size, shape.n_v_heads, shape.n_v_heads), dim=-1)
    padded = torch.cat([conv_state.float(), mixed.transpose(1, 2)], dim=-1)  # [B, conv_dim, kernel - 1 + T]
    conv = F.silu(F.conv1d(padded, conv_weight.float().unsqueeze(1), groups=shape.conv_dim))  # [B, conv_dim, T]
    new_conv = padded[:, :, padded.shape[-1] - (shape.kernel - 1):]
    q, k, v = conv.transpose(1, 2).split((shape.key_size, shape.key_size, shape.value_size), dim=-1)
    per = shape.n_v_heads // shape.n_k_heads
    q = _l2(q.reshape(bsz, seq, shape.n_k_heads, shape.k_dim))
    k = _l2(k.reshape(bsz, seq, shape.n_k_heads, shape.k_dim))
    q = q.repeat_interleave(per, dim=2) * shape.k_dim ** -0.5
    k = k.repeat_interleave(per, dim=2)
    v = v.reshape(bsz, seq, shape.n_v_heads, shape.v_dim)
    beta = torch.sigmoid(b)
    g = a_neg.float() * F.softplus(a + dt_bias.float())  # [B, T, Hv], <= 0
    state = recurrent.float()
    outs = []
    for t in range(seq):  # the gated delta rule, one token after another (module docstring)
        state = state * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        memory = (state * kt.unsqueeze(-1)).sum(dim=-2)  # [B, Hv, dv]
        delta = (v[:, t] - memory) * beta[:, t].unsqueeze(-1)
        state = state + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(dim=-2))
    out = torch.stack(outs, dim=1)  # [B, T, Hv, dv]
    out = F.rms_norm(out, (shape.v_dim,), norm.float(), eps) * F.silu(z.view(bsz, seq, shape.n_v_heads, shape.v_dim))
    return out.reshape(bsz, seq, -1), new_conv, state


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer: h [B, T, dim] -> [B, T, dim], each row's state read from and
    written back to its slot's row of the buffers (`StepInputs.state_at`)."""

    STATE: ClassVar[dict[str, dict[int, str]]] = {"conv_state": {0: "slots"}, "ssm_state": {0: "slots"}}

    def __init__(self, shape: DeltaNetShape, norm_eps: float) -> None:
        super().__init__()
        self.shape, self.norm_eps = shape, norm_eps
        # Filled by Transformer.build: the two linears in the step's forms, the rest float32.
        self.w_in: nn.Module = nn.Identity()
        self.w_out: nn.Module = nn.Identity()
        self.conv = self.dt_bias = self.a = self.norm = torch.empty(0)
        self.conv_state = self.ssm_state = torch.empty(0)

    def allocate(self, num_tokens: int, device: torch.device, dtype: torch.dtype, spare: int, num_slots: int) -> None:
        # float32 whatever the cache's dtype: a state is summed into at every token of the answer
        s = self.shape
        self.conv_state = torch.zeros(num_slots + 1, s.conv_dim, s.kernel - 1, device=device)
        self.ssm_state = torch.zeros(num_slots + 1, s.n_v_heads, s.k_dim, s.v_dim, device=device)

    def forward(self, h: Tensor, inputs: StepInputs, state: tuple[Tensor, ...]) -> Tensor:
        conv_all, ssm_all = state
        assert inputs.state_at is not None
        rows = inputs.state_at
        fresh = (inputs.positions[:, 0] == 0).view(-1, 1, 1)  # a request's first chunk: from zeros
        conv0 = conv_all[rows].masked_fill(fresh, 0.0)
        ssm0 = ssm_all[rows].masked_fill(fresh.unsqueeze(-1), 0.0)
        out, conv1, ssm1 = delta_step(in_pieces(self.w_in, h, inputs.pieces), self.conv, self.dt_bias, self.a,
                                      self.norm, self.shape, conv0, ssm0, self.norm_eps)
        conv_all[rows] = conv1
        ssm_all[rows] = ssm1
        return in_pieces(self.w_out, out, inputs.pieces)


def _l2(x: Tensor) -> Tensor:
    """transformers' (and FLA's) l2norm: x / sqrt(sum x^2 + 1e-6)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
