"""Choosing the next token of each row, with that row's own parameters and random stream.

Runs on the CPU in float32. Each slot owns a torch.Generator, so a seeded request draws the same
numbers whatever else shares its batch: same seed, same prompt, same params -> same tokens.

A sampled token costs one uniform number: the kept tokens' probabilities are summed in order and
the number picks where it falls (inverse CDF). torch.multinomial instead draws an exponential per
vocabulary entry (~0.7 ms a row for SmolLM2's 49k), and top_p sorted the whole vocabulary (~3 ms
a row): at 8 rows those cost more than the model's step. top_p looks at the largest 256 logits
first, then 4 096 (`NUCLEUS_FIRST`), and sorts everything only when those hold less than top_p
of the mass. One draw per token also lets a resumed request continue its seeded stream
(`SamplingParams.already_sampled`)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from engine.protocol import SamplingParams


NUCLEUS_FIRST = (256, 4096)  # top_p: candidates looked at, in turn, before sorting the whole vocabulary


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
        sampler = cls(params=params, generator=generator)
        if params.already_sampled and not sampler.is_greedy:  # continue the stream where it was
            torch.rand(params.already_sampled, generator=generator)
        return sampler

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
    """logits: [V] float32 -> a token drawn from softmax(logits / temperature), restricted to the
    top_k largest and then to the smallest prefix (largest first) whose mass reaches top_p."""
    p = sampler.params
    scaled = logits / p.temperature
    vocab = scaled.shape[0]
    by_top_k = 0 < p.top_k < vocab
    ids: Tensor | None = None
    values = scaled
    if by_top_k:
        values, ids = torch.topk(scaled, p.top_k)  # largest first
    if p.top_p < 1.0:
        if by_top_k:
            probs = torch.softmax(values, dim=-1)
        else:  # the largest few first: an LM's nucleus is small; a flat distribution takes all
            total = torch.logsumexp(scaled, dim=-1)
            for first in (*NUCLEUS_FIRST, vocab):
                values, ids = torch.topk(scaled, min(first, vocab))
                probs = torch.exp(values - total)
                if first >= vocab or float(probs.sum()) >= p.top_p:
                    break
        # keep a token while the tokens before it hold less than top_p (the first always stays)
        kept = max(1, int(((torch.cumsum(probs, dim=-1) - probs) < p.top_p).sum()))
        values, ids = values[:kept], ids[:kept]
    cumulative = torch.cumsum(torch.softmax(values, dim=-1), dim=-1)
    u = torch.rand(1, generator=sampler.generator) * cumulative[-1]
    # u can round up to the total: then the last token with any probability (never a masked one)
    index = min(int(torch.searchsorted(cumulative, u, right=True)), int((cumulative < cumulative[-1]).sum()))
    return index if ids is None else int(ids[index])
