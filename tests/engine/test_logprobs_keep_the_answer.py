"""Asking for logprobs reports exact logits (engine/exact_head.py) but must not change what a
sampled request answers: every row samples from the same logits (Transformer.exact_top)."""

from __future__ import annotations

import torch

from engine.protocol import SamplingParams
from engine.sampling import SlotSampler, sample_tokens
from tests.helpers.logprobs import model_with_head


def _spread() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(5)
    weight = torch.randn(2048, 256) * torch.rand(2048, 1)
    return torch.randn(16, 256) * 0.6, weight


def _draws(model, h: torch.Tensor, logprobs: int | None, seed: int) -> tuple[list[int], list]:
    sampler = SlotSampler(SamplingParams(temperature=1.0, seed=seed, logprobs=logprobs))
    sampler.generator.manual_seed(seed)
    tokens = []
    for row in range(h.shape[0]):
        scored = torch.tensor([True]) if logprobs is not None else None
        out = model.logits(h[row:row + 1].clone(), scored=scored)
        reported = out[1:] if logprobs is not None else None
        tokens += sample_tokens(out[:1], [sampler], frozenset(), reported)
    return tokens, sampler.take_logprobs()


def test_a_sampled_answer_is_the_same_with_logprobs_or_without():
    h, weight = _spread()
    model = model_with_head(weight)
    for seed in range(16):
        plain, _ = _draws(model, h, None, seed)
        scored, logprobs = _draws(model, h, 5, seed)
        assert plain == scored
        exact = torch.log_softmax((h.double() @ weight.double().T).float(), -1)
        for row, entry in enumerate(logprobs):
            assert entry.token == plain[row]
            assert abs(entry.logprob - float(exact[row, entry.token])) < 1e-4
            assert [t for t, _ in entry.top] == torch.topk(exact[row], 5).indices.tolist()


def test_the_int8_heads_rows_would_have_sampled_otherwise():
    """Why the rows are kept apart: sampling from the exact rows changes some answer here (so
    the test above could fail), while their logprobs are what a float32 head gives."""
    h, weight = _spread()
    model = model_with_head(weight)
    changed = 0
    for seed in range(16):
        plain, _ = _draws(model, h, None, seed)
        sampler = SlotSampler(SamplingParams(temperature=1.0, seed=seed))
        sampler.generator.manual_seed(seed)
        exact_rows = [sample_tokens(model.logits(h[r:r + 1].clone(), scored=torch.tensor([True]))[1:], [sampler],
                                    frozenset())[0] for r in range(h.shape[0])]
        changed += exact_rows != plain
    assert changed > 0
