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
per token also lets a resumed request continue its seeded stream (`SamplingParams.already_sampled`).

Each row is processed in a fixed order (agreed with engine/grammar.py): its constraint's mask
first (disallowed tokens -> -inf), then logit_bias (-100 or less bans a token outright), the
repetition penalty (transformers' rule, over the prompt and the answer), the presence and
frequency penalties (OpenAI's, over the answer), min_tokens' end-of-sequence mask; then
temperature, min_p, top_k, top_p. Logprobs are the log-softmax of the processed logits before
temperature: the model's own distribution when a request sets no bias, penalty or constraint.
Rows without any of these skip the processing: a plain batch costs what it did."""

from __future__ import annotations

import math
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
from torch import Tensor

from engine.protocol import SamplingParams, TokenLogprob


NUCLEUS_FLOORS = (1e-4, 1e-5)  # top_p: the probabilities from which tokens are looked at, in turn
BAN = -100.0  # a logit_bias this low removes the token (OpenAI: "-100 should result in a ban")


class Constraint(Protocol):
    """What a constrained row carries (engine/grammar.py builds them)."""

    def allowed(self) -> Tensor | None:
        """bool [V]: the tokens allowed next; None: anything goes now."""

    def accept(self, token: int) -> None:
        """The row's chosen token: advance the constraint's state past it."""

    @property
    def is_done(self) -> bool: ...


@dataclass
class SlotSampler:
    """One slot's sampling state: its params, its random stream, how many tokens it has drawn,
    what its penalties look at and the logprobs of the tokens drawn since they were last taken."""

    params: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)
    num_sampled: int = 0
    constraint: Constraint | None = None
    seen: list[int] = field(default_factory=list)  # what the slot's cache holds (kept for repetition_penalty only)
    answer_counts: Counter[int] = field(default_factory=Counter)  # the answer's tokens (presence/frequency)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the sampled tokens', not yet taken

    @classmethod
    def start(cls, params: SamplingParams, constraint: Constraint | None = None) -> "SlotSampler":
        generator = torch.Generator(device="cpu")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator.manual_seed(seed)
        sampler = cls(params=params, generator=generator, constraint=constraint)
        if params.already_sampled and not sampler.is_greedy:  # continue the stream where it was
            torch.rand(params.already_sampled, generator=generator)
        return sampler

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature <= 0.0 or self.params.top_k == 1

    @property
    def is_plain(self) -> bool:
        """Nothing changes its logits before temperature (min_tokens' mask aside)."""
        return self.constraint is None and self.params.is_plain

    def observe(self, tokens: Sequence[int]) -> None:
        """Tokens the slot's cache now holds (prompt chunks, and the answer as it is fed back). A
        resumed request's tokens from before count as its answer (`already_sampled`)."""
        p = self.params
        if p.repetition_penalty != 1.0 or (p.already_sampled and (p.presence_penalty or p.frequency_penalty)):
            self.seen.extend(tokens)

    def take_logprobs(self) -> list[TokenLogprob]:
        taken, self.logprobs = self.logprobs, []
        return taken

    def _resumed_answer(self) -> None:
        """A resumed request read its earlier answer as prompt: count it as answer once."""
        done = self.params.already_sampled
        if done and self.num_sampled == 0 and self.seen and not self.answer_counts:
            self.answer_counts.update(self.seen[-done:])

    def _took(self, token: int) -> None:
        self.num_sampled += 1
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.answer_counts[token] += 1
        if self.constraint is not None:
            self.constraint.accept(token)


def sample_tokens(logits: Tensor, samplers: Sequence[SlotSampler], eos_token_ids: frozenset[int],
                  reported: Tensor | None = None) -> list[int]:
    """logits: [B, V] (any device/dtype) -> one token id per row; each sampler counts its token
    (and, with params.logprobs set, keeps its TokenLogprob, from `reported` [B, V] when given: the
    exact rows of Transformer.exact_top, processed as the sampled ones are)."""
    logits = _processed(logits, samplers, eos_token_ids)
    scores = logits if reported is None else _processed(reported, samplers, eos_token_ids)
    # the argmax only where a row is greedy (it is a pass over the vocabulary)
    greedy_rows = [row for row, sampler in enumerate(samplers) if sampler.is_greedy]
    picked = logits if len(greedy_rows) == len(samplers) else logits[greedy_rows]
    greedy = dict(zip(greedy_rows, picked.argmax(dim=-1).tolist())) if greedy_rows else {}
    tokens = []
    for row, sampler in enumerate(samplers):
        token = greedy[row] if sampler.is_greedy else _sample_row(logits[row], sampler)
        if sampler.params.logprobs is not None:
            sampler.logprobs.append(score(scores[row], token, sampler.params.logprobs))
        sampler._took(token)
        tokens.append(token)
    return tokens


def _processed(logits: Tensor, samplers: Sequence[SlotSampler], eos_token_ids: frozenset[int]) -> Tensor:
    """logits [B, V] -> float32 on the CPU, each row through its sampler's processing and
    min_tokens' end-of-sequence mask (the module docstring's order)."""
    logits = logits.detach().to(device="cpu", dtype=torch.float32)
    processed = [i for i, s in enumerate(samplers) if not s.is_plain]
    young = [i for i, s in enumerate(samplers) if s.num_sampled < s.params.min_tokens] if eos_token_ids else []
    if processed or young:
        logits = logits.clone()  # the caller's rows stay as the model gave them
    for row in processed:
        _process(logits[row], samplers[row])
    if young:
        eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
        eos = eos[eos < logits.shape[1]]
        logits[torch.tensor(young).unsqueeze(1), eos.unsqueeze(0)] = float("-inf")
    return logits


def score(logits: Tensor, token: int, top: int) -> TokenLogprob:
    """logits: [V] float32 -> the token's log-probability under log_softmax(logits) and the
    `top` likeliest tokens, largest first (ties: the lower id first)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    entries: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[0]))
        entries = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), entries)


def score_prompt(logits: Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits: [T, V] of T consecutive positions, targets: the T tokens that followed them -> each
    target's TokenLogprob (teacher forcing: what the model gave the prompt's own next token)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(targets), dtype=torch.long)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen)]
    values, top_ids = torch.topk(logprobs, min(top, logprobs.shape[1]), dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(targets, chosen, top_ids.tolist(), values.tolist())]


def _process(row: Tensor, sampler: SlotSampler) -> None:
    """row: [V] float32, changed in place by the constraint's mask, logit_bias and the penalties."""
    p = sampler.params
    vocab = row.shape[0]
    if sampler.constraint is not None:
        allowed = sampler.constraint.allowed()
        if allowed is not None:
            mask = torch.zeros(vocab, dtype=torch.bool)
            n = min(vocab, allowed.shape[0])
            mask[:n] = allowed[:n].to(device="cpu", dtype=torch.bool)
            row.masked_fill_(~mask, float("-inf"))
    if p.logit_bias:
        pairs = [(t, b) for t, b in p.logit_bias if 0 <= t < vocab]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
            bias = torch.tensor([b for _, b in pairs], dtype=torch.float32)
            row[ids] = torch.where(bias <= BAN, torch.full_like(bias, float("-inf")), row[ids] + bias)
    sampler._resumed_answer()
    if p.repetition_penalty != 1.0 and sampler.seen:
        ids = torch.tensor(sorted({t for t in sampler.seen if 0 <= t < vocab}), dtype=torch.long)
        values = row[ids]
        row[ids] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and sampler.answer_counts:
        pairs = [(t, c) for t, c in sampler.answer_counts.items() if 0 <= t < vocab]
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        counts = torch.tensor([c for _, c in pairs], dtype=torch.float32)
        row[ids] -= p.presence_penalty + p.frequency_penalty * counts


def _sample_row(logits: Tensor, sampler: SlotSampler) -> int:
    """logits: [V] float32 -> a token drawn from softmax(logits / temperature), restricted to the
    tokens at least min_p as likely as the top one, to the top_k largest and then to the smallest
    prefix (largest first) whose mass reaches top_p."""
    p = sampler.params
    scaled = logits / p.temperature if p.temperature != 1.0 else logits  # a pass over the vocabulary
    if p.min_p > 0.0:
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(p.min_p), float("-inf"))
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
    # u can round up to the total: then the last token with any probability (never a masked one);
    # only then is that token looked for (a pass over the vocabulary)
    index = int(torch.searchsorted(cumulative, u, right=True))
    if index >= cumulative.shape[0]:
        index = int((cumulative < cumulative[-1]).sum())
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
