"""A mixture-of-experts FFN (Qwen3-MoE, Mixtral, Qwen3-Next's routed + shared experts).

The router picks `top_k` of E SwiGLU experts for each token (softmax over all E, the top k, and
their weights renormalized to sum to one where the config says so: Mixtral always,
Qwen3-MoE's `norm_topk_prob`); each expert runs on the rows routed to it only, and a row's output
is the weighted sum of its k experts' outputs. A shared expert (Qwen3-Next) runs on every row,
scaled by a sigmoid gate of its own.

Two ways to run the routed experts, both with shapes fixed by the number of rows (no
data-dependent sizes, so a compiled or exported step can hold them), chosen by the step's shape
(one token a row or several), which a compiled decode graph has fixed:
- a decode step (one token a row, few (row, expert) pairs): each pair's expert matrices gathered
  and applied with a batched matmul; only the chosen experts' weights are read.
- a prefill chunk: the pairs sorted by expert and every expert's rows multiplied at once by
  `torch._grouped_mm` (one grouped GEMM over the per-expert segments, on the CPU and on CUDA).

Routing is in float32 whatever the activations' dtype: a bf16 router's near-ties would pick other
experts than the model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Experts(nn.Module):
    """router [E, dim] float32; gate_up [E, 2I, dim] and down [E, dim, I] in the activations'
    dtype; shared: an optional (gate_up, down, gate [1, dim]) modules/tensor of the shared expert."""

    def __init__(self, router: Tensor, gate_up: Tensor, down: Tensor, top_k: int, normalize: bool,
                 shared: tuple[nn.Module, nn.Module, Tensor] | None = None) -> None:
        super().__init__()
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k, self.normalize = top_k, normalize
        self.shared_gate_up, self.shared_down, self.shared_gate = shared if shared is not None else (None, None, None)

    @property
    def n_experts(self) -> int:
        return self.router.shape[0]

    def route(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """h: [N, dim] -> (weights [N, k] float32, experts [N, k] long)."""
        probs = torch.softmax(F.linear(h.float(), self.router), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, h: Tensor) -> Tensor:
        """h: [B, T, dim] (the FFN norm's output) -> [B, T, dim] in the experts' dtype."""
        shape = h.shape
        flat = h.reshape(-1, shape[-1])
        weights, experts = self.route(flat)
        x = flat.to(self.gate_up.dtype)
        if shape[1] == 1:
            out = self._gathered(x, weights, experts)
        else:
            out = self._grouped(x, weights, experts)
        if self.shared_gate_up is not None:
            gate, up = self.shared_gate_up(flat).chunk(2, dim=-1)
            scale = torch.sigmoid(F.linear(flat.float(), self.shared_gate))
            out = out + (self.shared_down(F.silu(gate) * up).float() * scale).to(out.dtype)
        return out.view(shape)

    def _gathered(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        n, k = experts.shape
        chosen = experts.reshape(-1)
        rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [N*k, dim, 1]
        gate, up = torch.bmm(self.gate_up[chosen], rows).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down[chosen], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [N*k, dim]
        y = y.float() * weights.reshape(-1, 1)
        return y.view(n, k, -1).sum(dim=1).to(x.dtype)

    def _grouped(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        n, k = experts.shape
        chosen = experts.reshape(-1)
        order = chosen.argsort(stable=True)  # pairs grouped by expert, in row order within one
        rows = order // k
        ends = torch.bincount(chosen, minlength=self.n_experts).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x[rows], self.gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)  # [N*k, dim]
        y = y.float() * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros(n, x.shape[-1], device=x.device).index_add_(0, rows, y).to(x.dtype)
