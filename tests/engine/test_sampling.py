"""Sampling on made-up logits: no model needed."""

from __future__ import annotations

import torch

from engine.protocol import SamplingParams
from engine.sampling import SlotSampler, sample_tokens

V = 1000
EOS = frozenset({7, 8})


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(params: SamplingParams, steps: int = 20, batch_noise: bool = False) -> list[int]:
    sampler = SlotSampler.start(params)
    others = SlotSampler.start(SamplingParams(temperature=1.0, seed=None))
    out = []
    for step in range(steps):
        logits = _logits(2, seed=step)
        if batch_noise:  # another unseeded request shares the batch
            out.append(sample_tokens(logits, [sampler, others], EOS)[0])
        else:
            out.append(sample_tokens(logits[:1], [sampler], EOS)[0])
    return out


def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    assert _draw(params) == _draw(params) == _draw(params, batch_noise=True)


def test_different_seed_different_tokens():
    assert _draw(SamplingParams(temperature=1.0, seed=1)) != _draw(SamplingParams(temperature=1.0, seed=2))


def test_top_k_one_equals_greedy():
    greedy = _draw(SamplingParams(temperature=0.0))
    assert _draw(SamplingParams(temperature=0.8, top_k=1, seed=5)) == greedy
    assert greedy == [int(_logits(2, seed=s)[0].argmax()) for s in range(20)]


def test_top_k_and_top_p_keep_only_the_head():
    logits = _logits(1, seed=3)
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    sampler = SlotSampler.start(SamplingParams(temperature=2.0, top_k=5, seed=0))
    assert {sample_tokens(logits, [sampler], EOS)[0] for _ in range(50)} <= top5
    # top_p tiny: only the most likely token survives
    sampler = SlotSampler.start(SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    assert {sample_tokens(logits, [sampler], EOS)[0] for _ in range(20)} == {int(logits[0].argmax())}


def test_min_tokens_masks_eos():
    logits = torch.zeros(1, V)
    logits[0, 7] = 100.0  # eos would always win
    sampler = SlotSampler.start(SamplingParams(temperature=0.0, min_tokens=3))
    tokens = [sample_tokens(logits, [sampler], EOS)[0] for _ in range(4)]
    assert all(t not in EOS for t in tokens[:3]) and tokens[3] == 7
