"""Sampling on made-up logits: no model needed."""

from __future__ import annotations

import dataclasses
import math

import pytest
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


def _expected(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution by the book: softmax(logits / T), the top_k largest, then the smallest
    prefix (largest first) whose mass reaches top_p, renormalized."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[0]:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, params.top_k).values[-1], float("-inf"))
    ordered, order = torch.sort(scaled, descending=True)
    probs = torch.softmax(ordered.double(), dim=-1)
    probs[(torch.cumsum(probs, dim=-1) - probs) >= params.top_p] = 0
    out = torch.zeros_like(probs)
    out[order] = probs / probs.sum()
    return out


@pytest.mark.parametrize("params, floors", [
    (SamplingParams(temperature=1.0, seed=11), None),
    (SamplingParams(temperature=0.7, top_k=5, seed=12), None),
    (SamplingParams(temperature=1.3, top_p=0.8, seed=13), None),
    (SamplingParams(temperature=1.0, top_k=9, top_p=0.6, seed=14), None),
    # the tokens above the first floors hold less than top_p: the next floor, then the last one
    (SamplingParams(temperature=1.0, top_p=0.9, seed=15), (0.2, 0.1)),
])
def test_drawn_tokens_follow_the_distribution(params, floors, monkeypatch):
    from engine import sampling

    if floors:
        monkeypatch.setattr(sampling, "NUCLEUS_FLOORS", floors)
    logits = torch.tensor([[2.0, 1.5, 1.4, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0, -9.0, 0.1]])
    expected = _expected(logits[0], params)
    sampler = SlotSampler.start(params)
    n = 20000
    counts = torch.bincount(torch.tensor([sample_tokens(logits, [sampler], frozenset())[0] for _ in range(n)]),
                            minlength=logits.shape[1]).double() / n
    assert torch.all(counts[expected == 0] == 0)  # cut tokens are never drawn
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / n) + 1e-9
    assert torch.all((counts - expected).abs() <= tolerance), (counts, expected)


def test_a_resumed_request_continues_its_seeded_stream():
    """A request resumed after 4 sampled tokens (its worker died) draws the numbers the
    undisturbed run would have drawn next: same logits, same tokens."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=99)
    whole = _draw(params, steps=10)
    resumed = SlotSampler.start(dataclasses.replace(params, already_sampled=4))
    rest = [sample_tokens(_logits(2, seed=step)[:1], [resumed], EOS)[0] for step in range(4, 10)]
    assert rest == whole[4:]


def test_a_draw_at_the_very_top_of_the_range_never_lands_on_a_masked_token(monkeypatch):
    """The uniform number times the total can round up to the total; the token it then picks
    must still have probability: here the vocabulary's last entries are masked (eos under
    min_tokens, or -inf)."""
    logits = torch.tensor([[1.0, 2.0, 0.5, float("-inf"), float("-inf")]])
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.tensor([1.0]))  # the top of [0, 1)
    sampler = SlotSampler.start(SamplingParams(temperature=1.0, seed=1))
    assert sample_tokens(logits, [sampler], frozenset())[0] == 2


def _by_the_book(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """top_p over the whole vocabulary sorted, with the same arithmetic and the same one draw."""
    scaled = logits / params.temperature
    values, ids = torch.sort(scaled, descending=True, stable=True)
    probs = torch.exp(values - torch.logsumexp(scaled, dim=-1))
    kept = max(1, int(((torch.cumsum(probs, dim=-1) - probs) < params.top_p).sum()))
    cumulative = torch.cumsum(torch.softmax(values[:kept], dim=-1), dim=-1)
    u = torch.rand(1, generator=generator) * cumulative[-1]
    index = min(int(torch.searchsorted(cumulative, u, right=True)), int((cumulative < cumulative[-1]).sum()))
    return int(ids[index])


@pytest.mark.parametrize("temperature, top_p", [(0.6, 0.9), (0.8, 0.95), (1.0, 0.95), (1.5, 0.99), (1.0, 0.5)])
def test_top_p_looks_at_few_tokens_and_draws_what_sorting_them_all_would(temperature, top_p, monkeypatch):
    """A vocabulary of SmolLM2's size with a language model's shape (a few tokens far ahead, a
    long flat tail), rows from peaked to nearly flat: the same tokens, draw for draw, as sorting
    the whole vocabulary, while the sort sees only the tokens above the first floor that holds
    top_p."""
    vocab, rows = 49152, 40
    gen = torch.Generator().manual_seed(3)
    tails = torch.randn(rows, vocab, generator=gen)
    heads = torch.linspace(30.0, 0.0, rows).unsqueeze(1) * torch.rand(rows, 30, generator=gen)
    logits = tails.clone()
    logits[:, :30] += heads  # row 0 peaked, the last row about as flat as its noise
    logits = logits[:, torch.randperm(vocab, generator=gen)]
    sorted_sizes = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda t, *a, **kw: sorted_sizes.append(t.shape[-1]) or real_sort(t, *a, **kw))
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=21)
    sampler = SlotSampler.start(params)
    drawn = [sample_tokens(logits[row:row + 1], [sampler], frozenset())[0] for row in range(rows)]
    monkeypatch.setattr(torch, "sort", real_sort)
    reference = torch.Generator().manual_seed(21)
    assert drawn == [_by_the_book(logits[row], params, reference) for row in range(rows)]
    # one sort a row; the peaked quarter of the rows sorts a handful of tokens each, not 49 152
    assert len(sorted_sizes) == rows and max(sorted_sizes[:rows // 4]) < 100, sorted_sizes


# ---- logit_bias, penalties, min_p, the constraint hook, logprobs ------------------------------


def _probs_of(logits: torch.Tensor, params: SamplingParams, n: int = 4000, history: list[int] = ()) -> torch.Tensor:
    sampler = SlotSampler.start(params)
    sampler.observe(history)
    counts = torch.zeros(logits.shape[1])
    for _ in range(n):
        counts[sample_tokens(logits, [sampler], frozenset())[0]] += 1
        sampler.answer_counts.clear()  # every draw from the same state
    return counts / n


def test_logit_bias_adds_to_the_logit_and_minus_100_bans():
    logits = torch.zeros(1, 4)
    # +ln(3) on token 1: it becomes three times as likely as each other token
    probs = _probs_of(logits, SamplingParams(seed=1, logit_bias=((1, math.log(3.0)),)))
    assert probs[1] == pytest.approx(0.5, abs=0.04) and probs[0] == pytest.approx(1 / 6, abs=0.03)
    big = torch.tensor([[50.0, 0.0, 0.0, 0.0]])  # token 0 far ahead: -100 still removes it
    assert _probs_of(big, SamplingParams(seed=2, logit_bias=((0, -100.0),)), n=500)[0] == 0
    greedy = SlotSampler.start(SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)))
    assert sample_tokens(torch.tensor([[500.0, 1.0, 2.0, 0.0]]), [greedy], frozenset()) == [2]


def test_presence_and_frequency_penalties_subtract_per_token_of_the_answer():
    sampler = SlotSampler.start(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25))
    logits = torch.tensor([[3.0, 2.9, 2.0, 0.0]])
    # token 0 wins, then it is penalized by 0.5 + 0.25 = 0.75 -> 2.25 < 2.9: token 1, then
    # both penalized 0.75 -> 2.25 vs 2.15: token 0 again, now 3 - 0.5 - 0.5 = 2.0 < 2.15: token 1
    assert [sample_tokens(logits, [sampler], frozenset())[0] for _ in range(4)] == [0, 1, 0, 1]
    assert sampler.answer_counts == {0: 2, 1: 2}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_the_context():
    sampler = SlotSampler.start(SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=0))
    sampler.observe([0, 3])  # the prompt held tokens 0 and 3
    logits = torch.tensor([[4.0, 2.5, 1.0, -1.0]])
    assert sample_tokens(logits, [sampler], frozenset()) == [1]  # 4 / 2 = 2 < 2.5
    expected = torch.log_softmax(torch.tensor([2.0, 2.5, 1.0, -2.0]), dim=-1)
    [entry] = sampler.take_logprobs()
    assert entry.token == 1 and entry.logprob == pytest.approx(float(expected[1]), abs=1e-6)


def test_min_p_cuts_tokens_below_its_share_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    probs = _probs_of(logits, SamplingParams(seed=4, min_p=0.2))  # keeps p >= 0.1
    assert probs[3] == 0 and probs[2] > 0
    assert probs[0] == pytest.approx(0.5 / 0.92, abs=0.04)


class _Only:
    """A constraint that allows a fixed set of tokens, recording what it was told."""

    def __init__(self, allowed: set[int], vocab: int) -> None:
        self.mask = torch.tensor([i in allowed for i in range(vocab)])
        self.accepted: list[int] = []

    def allowed(self):
        return self.mask

    def accept(self, token: int) -> None:
        self.accepted.append(token)

    @property
    def is_done(self) -> bool:
        return False


def test_the_constraint_masks_first_and_hears_of_the_chosen_token():
    constraint = _Only({2, 3}, V)
    # a bias lifts a disallowed token far ahead: the mask still wins (it comes first)
    sampler = SlotSampler.start(SamplingParams(seed=3, logit_bias=((5, 100.0),), logprobs=2), constraint)
    tokens = [sample_tokens(_logits(1, seed=s), [sampler], frozenset())[0] for s in range(30)]
    assert set(tokens) <= {2, 3} and constraint.accepted == tokens
    # logprobs come from the processed distribution: only the allowed tokens have any mass
    entries = sampler.take_logprobs()
    assert all({t for t, _ in e.top} == {2, 3} for e in entries)
    assert all(sum(math.exp(lp) for _, lp in e.top) == pytest.approx(1.0, abs=1e-5) for e in entries)


def test_logprobs_are_the_log_softmax_sorted_and_include_the_greedy_token():
    logits = _logits(3, seed=9)
    samplers = [SlotSampler.start(SamplingParams(temperature=0.0, logprobs=5)) for _ in range(3)]
    tokens = sample_tokens(logits, samplers, frozenset())
    for row, (sampler, token) in enumerate(zip(samplers, tokens)):
        [entry] = sampler.take_logprobs()
        reference = torch.log_softmax(logits[row], dim=-1)
        assert entry.token == token and entry.logprob == pytest.approx(float(reference.max()), abs=1e-6)
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True) and entry.top[0][0] == token
        assert [t for t, _ in entry.top] == torch.topk(reference, 5).indices.tolist()


def test_plain_rows_are_not_touched_by_a_processed_neighbour():
    logits = _logits(2, seed=1)
    before = logits.clone()
    plain = SlotSampler.start(SamplingParams(temperature=0.0))
    biased = SlotSampler.start(SamplingParams(temperature=0.0, logit_bias=((int(logits[1].argmax()), -100.0),)))
    tokens = sample_tokens(logits, [plain, biased], frozenset())
    assert tokens[0] == int(before[0].argmax()) and tokens[1] != int(before[1].argmax())
    assert torch.equal(logits, before)  # the caller's logits are left as they were
