"""Qwen3-Next's Gated DeltaNet: a linear-attention mixer whose memory of the past is a fixed-size
state per slot instead of K/V entries per position.

Per slot and layer the state is two buffers: the last `kernel - 1` inputs of the short causal
convolution over q/k/v (`conv`, [conv_dim, kernel - 1]) and the recurrent matrix of each value
head (`recurrent`, [Hv, dk, dv], float32). A token t updates it (the gated delta rule):

    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

with q, k l2-normalized (q also by 1/sqrt(dk)), beta = sigmoid(b), g = -exp(A_log) softplus(a +
dt_bias); the output is RMS-normed per head, times silu(z), then projected. A decode step (fewer
than `CHUNKED_FROM` tokens) runs the rule token by token (`delta_rule_steps`); a longer read runs
its chunkwise form (`delta_rule_chunked`: 64 tokens at a time, a triangular solve and matmuls),
which equals the token-by-token rule within float32 rounding (about 1e-6 relative measured on
random inputs, tests/engine/test_qwen3_next.py). Either way the state after a read is the state
before it advanced by its tokens, and nothing else: so where a prompt is cut into the step's
chunks, or the rule's chunks fall inside it, changes the state only by that rounding, and a prompt
read in pieces gives what one read gives.

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
    if seq < CHUNKED_FROM:
        out, state = delta_rule_steps(q, k, v, beta, g, recurrent.float())
    else:
        out, state = delta_rule_chunked(q, k, v, beta, g, recurrent.float())
    out = F.rms_norm(out, (shape.v_dim,), norm.float(), eps) * F.silu(z.view(bsz, seq, shape.n_v_heads, shape.v_dim))
    return out.reshape(bsz, seq, -1), new_conv, state


CHUNKED_FROM = 16  # below this many tokens the loop is as fast (a decode step is one token)
CHUNK = 64


def delta_rule_steps(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule one token after another (the reference the chunked form must equal):
    q, k [B, T, Hv, dk], v [B, T, Hv, dv], beta, g [B, T, Hv], state [B, Hv, dk, dv] float32 ->
    (outputs [B, T, Hv, dv], the state after the last token)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        memory = (state * kt.unsqueeze(-1)).sum(dim=-2)  # [B, Hv, dv]
        delta = (v[:, t] - memory) * beta[:, t].unsqueeze(-1)
        state = state + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(dim=-2))
    return torch.stack(outs, dim=1), state


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor,
                       chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """`delta_rule_steps` with a chunk of tokens at a time in matmuls (same arguments and result).

    Within a chunk, with G_t the sum of g up to t and S0 the state before it, the state after t
    is exp(G_t) S0 + sum_{i<=t} exp(G_t - G_i) k_i u_i^T, where u_i is token i's write. Putting
    that into u_t = beta_t (v_t - S_{t-1}'s decayed read of k_t) gives a unit lower-triangular
    system (I + A) U = beta (V - exp(G) K S0), A[t, i] = beta_t exp(G_t - G_i) k_t.k_i for i < t,
    solved at once; the outputs and the state after the chunk follow with matmuls. A tail short
    of a whole chunk is padded with k = v = beta = 0 and g = 0: its tokens write nothing and
    decay nothing, so the state is the one after the real tokens."""
    bsz, seq, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -seq % chunk
    n = (seq + pad) // chunk

    def blocks(x: Tensor) -> Tensor:  # [B, T, Hv, ...] -> [B, Hv, N, C, ...]
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))
        return x.reshape(bsz, n, chunk, heads, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    qc, kc, vc, bc, gc = blocks(q), blocks(k), blocks(v), blocks(beta), blocks(g)
    cum = gc.cumsum(dim=-1)  # [B, Hv, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    # exp(G_t - G_i) for i <= t (<= 1); above the diagonal masked before exp, where it could overflow
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    kk = kc @ kc.transpose(-1, -2)
    a = (kk * decay * bc.unsqueeze(-1)).tril(-1)
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    qk = (qc @ kc.transpose(-1, -2)) * decay  # [B, Hv, N, C, C], i <= t
    kdecayed = kc * cum.exp().unsqueeze(-1)
    qdecayed = qc * cum.exp().unsqueeze(-1)
    tail = (cum[..., -1:] - cum).exp().unsqueeze(-1)  # exp(G_C - G_i): what a write has left at the end
    outs = []
    for c in range(n):  # the state carried from chunk to chunk
        rhs = bc[:, :, c].unsqueeze(-1) * (vc[:, :, c] - kdecayed[:, :, c] @ state)
        u = torch.linalg.solve_triangular(eye + a[:, :, c], rhs, upper=False, unitriangular=True)
        outs.append(qdecayed[:, :, c] @ state + qk[:, :, c] @ u)
        state = state * cum[:, :, c, -1].exp()[..., None, None] + (kc[:, :, c] * tail[:, :, c]).transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(bsz, heads, n * chunk, dv)[:, :, :seq]
    return out.transpose(1, 2), state


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
