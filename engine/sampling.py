"""Choosing the next token of each row, with that row's own parameters and random stream.

Runs on the CPU in float32. Each slot owns a torch.Generator, so a seeded request draws the same
numbers whatever else shares its batch: same seed, same prompt, same params -> same tokens."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from engine.protocol import SamplingParams


@dataclass
class SlotSampler:
    """One slot's sampling state: its params, its random stream, how many tokens it has drawn."""

    params: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)
    num_sampled: int = 0

    @classmethod
    def start(cls, params: SamplingParams) -> "SlotSampler":
        generator = torch.Generator(device="cpu")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator.manual_seed(seed)
        return cls(params=params, generator=generator)

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature <= 0.0 or self.params.top_k == 1


def sample_tokens(logits: Tensor, samplers: Sequence[SlotSampler], eos_token_ids: frozenset[int]) -> list[int]:
    """logits: [B, V] (any device/dtype) -> one token id per row; each sampler counts its token."""
    logits = logits.detach().to(device="cpu", dtype=torch.float32)
    if eos_token_ids:
        young = [i for i, s in enumerate(samplers) if s.num_sampled < s.params.min_tokens]
        if young:
            logits = logits.clone()
            eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
            eos = eos[eos < logits.shape[1]]
            logits[torch.tensor(young).unsqueeze(1), eos.unsqueeze(0)] = float("-inf")
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, sampler in enumerate(samplers):
        token = greedy[row] if sampler.is_greedy else _sample_row(logits[row], sampler)
        sampler.num_sampled += 1
        tokens.append(token)
    return tokens


def _sample_row(logits: Tensor, sampler: SlotSampler) -> int:
    # logits: [V] float32
    p = sampler.params
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token when the tokens strictly before it already reach top_p (the first stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=sampler.generator).item())
