"""fork(): n answers from one read. The read's cache copied into sibling slots, each sibling's
first token drawn from the read's logits under its own sampler; each answer is the one a
single request with its seed gives (the default precision, a tiny random model)."""

from __future__ import annotations

import pytest

from engine import SamplingParams, load_engine

PROMPT = list(range(300, 337))


def decode_on(engine, slots: list[int], firsts: list[int], steps: int) -> list[list[int]]:
    answers = [[t] for t in firsts]
    for _ in range(steps):
        new = engine.decode(slots, [a[-1] for a in answers])
        for answer, tokens in zip(answers, new):
            answer += tokens
    return answers


@pytest.fixture(scope="module")
def engine(tiny_model):
    return load_engine(tiny_model, num_slots=3, ctx=256, threads=1, compile=False, prompt_lookup=False)


@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.3, "logprobs": 2}])
def test_forked_answers_equal_single_requests_with_their_seeds(engine, extra):
    params = [SamplingParams(temperature=1.0, seed=11 + i, **extra) for i in range(3)]
    for slot, p in enumerate(params):
        engine.begin(slot, p)
    first = engine.read(0, PROMPT, sample=True)
    firsts = [first, *engine.fork(0, [1, 2])]
    assert [engine.position(s) for s in range(3)] == [len(PROMPT)] * 3
    together = decode_on(engine, [0, 1, 2], firsts, 5)
    assert len({tuple(a) for a in together}) == 3  # three seeds, three answers
    logprobs = [engine.logprobs(s) for s in range(3)]

    for i, p in enumerate(params):
        engine.begin(0, p)
        alone = decode_on(engine, [0], [engine.read(0, PROMPT, sample=True)], 5)[0]
        assert alone == together[i]
        if "logprobs" in extra:  # a row's sums in a step of 3 rows or of 1: equal to float32's rounding
            alone_lp = engine.logprobs(0)
            assert [(e.token, [t for t, _ in e.top]) for e in alone_lp] == \
                [(e.token, [t for t, _ in e.top]) for e in logprobs[i]]
            assert max(abs(a.logprob - b.logprob) for a, b in zip(alone_lp, logprobs[i])) < 1e-4


def test_fork_needs_a_read_that_sampled(engine):
    engine.begin(0, SamplingParams(temperature=0))
    engine.read(0, PROMPT, sample=False)
    with pytest.raises(ValueError, match="follows a read that sampled"):
        engine.fork(0, [1])
