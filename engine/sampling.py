"""Choosing the next token of each row, with that row's own parameters and random stream.

Runs on the CPU in float32. Each slot owns a torch.Generator, so a seeded request draws the same
numbers whatever else shares its batch: same seed, same prompt, same params -> same tokens.

A sampled token costs one uniform number: the kept tokens' probabilities are summed in order and
the number picks where it falls (inverse CDF). torch.multinomial instead draws an exponential per
vocabulary entry (~0.7 ms a row for SmolLM2's 49k), and top_p sorted the whole vocabulary (~2 ms
a row): at 8 rows those cost more than the model's step. top_p first takes the tokens of
probability 1e-4 or more (`NUCLEUS_FLOORS`; one comparison over the vocabulary, a few dozen to a
few hundred tokens on SmolLM2's answers) and sorts only those; when they hold less than top_p, a
lower floor, down to one at which the tokens left out cannot hold 1 - top_p between them. One draw
per token also lets a resumed request continue its seeded stream (`SamplingParams.already_sampled`)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from engine.protocol import SamplingParams


NUCLEUS_FLOORS = (1e-4, 1e-5)  # top_p: the probabilities from which tokens are looked at, in turn


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
    # the argmax only where a row is greedy (it is a pass over the vocabulary)
    greedy_rows = [row for row, sampler in enumerate(samplers) if sampler.is_greedy]
    picked = logits if len(greedy_rows) == len(samplers) else logits[greedy_rows]
    greedy = dict(zip(greedy_rows, picked.argmax(dim=-1).tolist())) if greedy_rows else {}
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
    scaled = logits / p.temperature if p.temperature != 1.0 else logits  # a pass over the vocabulary
    vocab = scaled.shape[0]
    by_top_k = 0 < p.top_k < vocab
    ids: Tensor | None = None
    values = scaled
    if by_top_k:
        values, ids = torch.topk(scaled, p.top_k)  # largest first
    if p.top_p < 1.0:
        if by_top_k:
            probs = torch.softmax(values, dim=-1)
        else:
            values, ids, probs = _nucleus_candidates(scaled, p.top_p)
        # keep a token while the tokens before it hold less than top_p (the first always stays)
        kept = max(1, int(((torch.cumsum(probs, dim=-1) - probs) < p.top_p).sum()))
        values, ids = values[:kept], ids[:kept]
    cumulative = torch.cumsum(torch.softmax(values, dim=-1), dim=-1)
    u = torch.rand(1, generator=sampler.generator) * cumulative[-1]
    # u can round up to the total: then the last token with any probability (never a masked one)
    index = min(int(torch.searchsorted(cumulative, u, right=True)), int((cumulative < cumulative[-1]).sum()))
    return index if ids is None else int(ids[index])


def _nucleus_candidates(scaled: Tensor, top_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """scaled: [V] logits / temperature -> (values, ids, probabilities) of the tokens whose
    probability reaches a floor, largest first, for the first floor whose tokens hold top_p of the
    mass. They are then the head of the whole vocabulary sorted, which is all the nucleus needs:
    every token left out is less likely than every token kept."""
    vocab = scaled.shape[0]
    total = torch.logsumexp(scaled, dim=-1)
    # below this floor even all the tokens together hold less than 1 - top_p: the last stage is always enough
    enough = (1.0 - top_p) / vocab
    for floor in [f for f in NUCLEUS_FLOORS if f > enough] + [enough]:
        ids = (scaled >= total + math.log(floor)).nonzero().squeeze(1)
        values = scaled[ids]
        probs = torch.exp(values - total)
        if floor == enough or float(probs.sum()) >= top_p:
            break
    values, order = torch.sort(values, descending=True, stable=True)
    return values, ids[order], probs[order]
