"""A mixture-of-experts FFN (Qwen3-MoE, Mixtral, Qwen3-Next's routed + shared experts).

The router picks `top_k` of E SwiGLU experts for each token (softmax over all E, the top k, and
their weights renormalized to sum to one where the config says so: Mixtral always,
Qwen3-MoE's `norm_topk_prob`); each expert runs on the rows routed to it only, and a row's output
is the weighted sum of its k experts' outputs. A shared expert (Qwen3-Next) runs on every row,
scaled by a sigmoid gate of its own.

Eagerly, the routed experts run as one grouped GEMM: the (row, expert) pairs sorted by expert and
every expert's rows multiplied at once by `torch._grouped_mm` over the per-expert segments,
reading each chosen expert's weights in place and skipping the others. Inside a compiled or
exported step (`torch.compiler.is_compiling()`) the pairs' matrices are gathered into one batched
matmul instead: `_grouped_mm` has no float32 lowering there (its meta function asks for bf16);
the gather has shapes fixed by the step's and compiles (a tiny Qwen3-MoE's packages: the same
greedy tokens as eager). On Qwen3-30B-A3B's expert shapes (dim 2048, 768, top 8 of 32, bf16, one
MoE layer, 2 cores shared by eight developers, best of 5), grouped vs gathered vs a Python loop
over the chosen experts: 1 row 99 ms vs 256 vs 266; 4 rows 899 vs 1 040 vs 594; 64 rows 943 vs
15 395 vs 2 260.

A quantized file's experts stay its blocks on the CPU (`Experts.of_blocks`, engine/quants'
`QuantExperts`): gate, up and down each one `strata_quants::mm_experts` over the (row, expert)
pairs, which reads each chosen expert's blocks once for all its rows and the others never, in
every form (eager, compiled, ahead of time: the op has a fake kernel), prompt and generated
tokens alike; float32 out, SiLU(gate) * up in float32 quantized per 32 by the down product as in
a quantized dense FFN. No dense copy: the weights held are the file's bytes.

Routing is in float32 whatever the activations' dtype: a bf16 router's near-ties would pick other
experts than the model's. As in the dense FFN (engine/layers.py `GatedFFN`, which the shared
expert is), SiLU(gate) * up runs in float32 from the gate/up product's output and is rounded once,
where the down product takes it (docs/engine.md, "Precision").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Experts(nn.Module):
    """router [E, dim] float32; gate_up [E, 2I, dim] and down [E, dim, I] in the activations'
    dtype (or, `of_blocks`, the three as pair products over the file's blocks); shared: an
    optional shared expert (a `GatedFFN`) and its gate [1, dim] float32."""

    def __init__(self, router: Tensor, gate_up: Tensor, down: Tensor, top_k: int, normalize: bool,
                 shared: tuple[nn.Module, Tensor] | None = None) -> None:
        super().__init__()
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k, self.normalize = top_k, normalize
        self.shared, self.shared_gate = shared if shared is not None else (None, None)
        self.blocks: nn.ModuleList | None = None

    @classmethod
    def of_blocks(cls, router: Tensor, gate: nn.Module, up: nn.Module, down: nn.Module, top_k: int, normalize: bool,
                  shared: tuple[nn.Module, Tensor] | None = None) -> "Experts":
        """gate, up, down: (x [P, in], experts [P]) -> [P, out] float32 (engine/quants
        `QuantExperts`): each (row, expert) pair's product, the file's blocks read in place."""
        experts = cls(router, torch.empty(0), torch.empty(0), top_k, normalize, shared)
        experts.blocks = nn.ModuleList([gate, up, down])
        return experts

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

    def forward(self, h: Tensor, pieces: tuple[int, ...] | None = None) -> Tensor:
        """h: [B, T, dim] (the FFN norm's output) -> [B, T, dim] in the experts' dtype (float32
        for experts from the file's blocks). pieces (a
        prompt's blocks, engine/weights.py `in_pieces`) are not needed by the routed experts (each
        expert's product takes the tokens routed to it whatever their number); the shared expert's
        linears take them as a dense FFN's do."""
        shape = h.shape
        flat = h.reshape(-1, shape[-1])
        weights, experts = self.route(flat)
        if self.blocks is not None:
            out = self._from_blocks(flat, weights, experts)
        else:
            x = flat.to(self.gate_up.dtype)
            # CUDA's grouped GEMM takes bf16 only (as does its compiled form everywhere)
            if torch.compiler.is_compiling() or (x.device.type != "cpu" and x.dtype != torch.bfloat16):
                out = self._gathered(x, weights, experts)
            else:
                out = self._grouped(x, weights, experts)
        if self.shared is not None:
            scale = torch.sigmoid(F.linear(flat.float(), self.shared_gate))
            shared = self.shared(h, pieces).reshape(flat.shape).float() * scale
            out = out + shared.to(out.dtype)
        return out.view(shape)

    def _gathered(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        n, k = experts.shape
        chosen = experts.reshape(-1)
        rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [N*k, dim, 1]
        gate, up = torch.bmm(self.gate_up[chosen], rows).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down[chosen], _act(gate, up).unsqueeze(-1)).squeeze(-1)  # [N*k, dim]
        y = y.float() * weights.reshape(-1, 1)
        return y.view(n, k, -1).sum(dim=1).to(x.dtype)

    def _from_blocks(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        assert self.blocks is not None
        gate_of, up_of, down_of = self.blocks
        n, k = experts.shape
        chosen = experts.reshape(-1)
        rows = x.float().repeat_interleave(k, dim=0)  # [N*k, dim]: pair p is row p // k
        y = down_of(F.silu(gate_of(rows, chosen)) * up_of(rows, chosen), chosen)  # [N*k, dim] float32
        return (y * weights.reshape(-1, 1)).view(n, k, -1).sum(dim=1)

    def _grouped(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        n, k = experts.shape
        chosen = experts.reshape(-1)
        order = chosen.argsort(stable=True)  # pairs grouped by expert, in row order within one
        rows = order // k
        ends = torch.bincount(chosen, minlength=self.n_experts).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x[rows], self.gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        y = torch._grouped_mm(_act(gate, up), self.down.transpose(1, 2), offs=ends)  # [N*k, dim]
        y = y.float() * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros(n, x.shape[-1], device=x.device).index_add_(0, rows, y).to(x.dtype)


def _act(gate: Tensor, up: Tensor) -> Tensor:
    """SiLU(gate) * up in float32, rounded once to the products' dtype (theirs take one dtype)."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
