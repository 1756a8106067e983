"""Prompt lookup (engine/lookup.py): a one-row decode step also checks a guessed token, and a
confirmed guess gives the tokens one step per token would, greedy or sampled. On the tiny random
model here (eager); test_compiled.py checks SmolLM2 through the packages."""

from __future__ import annotations

import pytest

from engine.lookup import Lookup
from engine.protocol import SamplingParams
from engine.runner import TorchEngine
from tests.helpers.tiny_engine import tiny_engine


def test_the_guess_is_what_followed_the_longest_earlier_run():
    lookup = Lookup()
    assert lookup.guess(5) == []  # nothing held
    lookup.extend([5, 1, 2, 3, 9, 1, 2, 4, 7, 1])
    assert lookup.guess(2) == [4]  # (1, 2) was followed by 3, then, latest, by 4
    assert lookup.guess(3) == []  # (1, 3) never occurred; a single token is not looked up
    lookup.extend([2])
    assert lookup.guess(3) == [9]  # (1, 2, 3), the longest run that occurred, was followed by 9
    assert lookup.guess(4) == [7]  # (7, 1, 2, 4)? never; (1, 2, 4) was followed by 7
    lookup.truncate(6)  # [5, 1, 2, 3, 9, 1]: what followed later is forgotten
    assert lookup.tokens == [5, 1, 2, 3, 9, 1] and lookup.guess(2) == [3]
    lookup.truncate(0)
    assert lookup.guess(1) == []


def test_a_run_of_the_longest_length_brings_what_followed_it_in_order():
    lookup = Lookup()
    lookup.extend([8, 1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3])
    assert lookup.guess(4) == [5, 6, 7]  # (1, 2, 3, 4) occurred: the three tokens after it
    shorter = Lookup(chain=2)
    shorter.extend(lookup.tokens)
    assert shorter.guess(4) == [5, 6] and lookup.guess(7) == []  # (2, 3, 7) never occurred
    lookup.extend([4, 5, 6])
    # (5, 6, 7)? (4, 5, 6, 7) occurred once: followed by 9, 1, 2
    assert lookup.guess(7) == [9, 1, 2]
    # what followed may run up to the token about to be fed: five 1s held, a sixth to be fed
    ones = Lookup()
    ones.extend([1, 1, 1, 1, 1])
    assert ones.guess(1) == [1, 1]  # (1, 1, 1, 1) was followed by the fifth 1, then by the sixth


def _generate(engine: TorchEngine, params: SamplingParams, prompt: list[int], length: int,
              counts: list[int] | None = None) -> tuple[list[int], int]:
    """Tokens from slot 1, and how many steps returned more than one (`counts`: each step's number)."""
    engine.begin(1, params)
    out = [engine.read(1, prompt, sample=True)]
    more = 0
    while len(out) < length:
        [new] = engine.decode([1], [out[-1]])
        more += len(new) > 1
        if counts is not None:
            counts.append(len(new))
        out += new
    return out[:length], more


# a prompt that repeats itself, so some guesses come right; long enough to cross the 256 span
PROMPT = [(i * 7) % 23 + 3 for i in range(40)] * 5


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=11),
                                    SamplingParams(temperature=0.6, top_k=20, seed=5)],
                         ids=["greedy", "top_p", "top_k"])
def test_confirmed_guesses_give_the_tokens_of_one_step_each(params):
    plain = tiny_engine()
    guessing = tiny_engine()
    guessing.use_prompt_lookup()
    want, none = _generate(plain, params, PROMPT, 150)
    got, more = _generate(guessing, params, PROMPT, 150)
    assert none == 0 and more >= 3, more
    assert got == want
    # and a slot taken over by the next request starts its guesses from its own tokens
    again, _ = _generate(guessing, params, PROMPT[:60], 40)
    assert again == _generate(plain, params, PROMPT[:60], 40)[0]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=11)], ids=["greedy", "top_p"])
@pytest.mark.parametrize("wrong", [None, 0, 1, 2])
def test_a_step_keeps_the_guesses_up_to_the_first_wrong_one(params, wrong):
    """Three guesses a step, told by what one token a step gives (the tiny model seldom repeats
    itself), the `wrong`-th of them made wrong: each step yields the next token and the guesses
    before the wrong one (all three right: four tokens), and the tokens are those of one step each."""
    prompt = PROMPT[:50]
    want, _ = _generate(tiny_engine(), params, prompt, 80)
    engine = tiny_engine()
    engine.use_prompt_lookup()
    lookup = engine._lookups[1]

    def told(last: int) -> list[int]:
        fed = len(lookup.tokens) - len(prompt)  # `last` is want[fed]
        following = list(want[fed + 1:fed + 4])
        if wrong is not None and wrong < len(following):
            following[wrong] = (following[wrong] + 1) % 256
        return following

    lookup.guess = told
    counts: list[int] = []
    got, _ = _generate(engine, params, prompt, 80, counts)
    assert got == want
    kept = 4 if wrong is None else wrong + 1  # the next token and the guesses before the wrong one
    assert counts[:-2] == [kept] * len(counts[:-2]), counts  # the last steps run out of what was told


def test_end_of_text_stays_masked_until_min_tokens_across_a_two_token_step():
    engine = tiny_engine()
    engine.use_prompt_lookup()
    plain = tiny_engine()
    first, _ = _generate(plain, SamplingParams(temperature=0.0), PROMPT, 60)
    eos = first[30]  # a token the free run produces: made end-of-text, masked for 40 tokens
    for e in (engine, plain):
        e.eos_token_ids = frozenset({eos})
    params = SamplingParams(temperature=0.0, min_tokens=40)
    got, two = _generate(engine, params, PROMPT, 60)
    want, _ = _generate(plain, params, PROMPT, 60)
    assert got == want and eos not in got[:40] and two > 0


@pytest.mark.parametrize("guessed", [[7], [7, 7, 7]])
def test_guesses_never_fill_the_slot_nor_outnumber_the_slots(guessed):
    """A full slot ends its request, so a step's guessed rows must not take the last position:
    with guesses at every step, the rows shrink near the end and the last row of a step is at
    most at ctx - 2. And a step has no more rows than slots (the batched package's largest)."""
    engine = tiny_engine(num_slots=3)
    engine.use_prompt_lookup()
    engine._lookups[0].guess = lambda last: list(guessed)  # always guesses (right or not)
    steps: list[list[int]] = []  # each model step's positions
    step = engine._step
    engine._step = lambda slots, tokens, positions, *rest, **named: steps.append(positions) or step(slots, tokens, positions, *rest, **named)
    engine.begin(0, SamplingParams(temperature=0.0))
    token = engine.read(0, PROMPT[: engine.ctx - 8], sample=True)
    while engine.position(0) < engine.ctx:
        token = engine.decode([0], [token])[0][-1]
    several = [p for p in steps if len(p) > 1]
    assert several and all(p[-1] <= engine.ctx - 2 for p in several)  # one position still free
    assert max(p[-1] for p in steps) == engine.ctx - 1
    assert max(len(p) for p in steps) == min(1 + len(guessed), 3)  # 3 slots: at most 3 rows
    assert all(len(p) == 1 for p in steps if p[0] + 2 >= engine.ctx)


def test_only_where_rows_do_not_depend_on_their_neighbours_and_two_rows_fit():
    engine = tiny_engine()
    engine.device = type(engine.device)("cuda", 0)  # as a GPU engine would say
    with pytest.raises(ValueError, match="the CPU"):
        engine.use_prompt_lookup()
    # one slot: its compiled steps take one row (a one-row package only)
    with pytest.raises(ValueError, match="two slots"):
        tiny_engine(num_slots=1).use_prompt_lookup()


def test_a_one_slot_engine_loads_without_lookup(tiny_model):
    from engine.load import load_engine

    engine = load_engine(tiny_model, num_slots=1, ctx=128, compile=False)
    assert not engine.prompt_lookup
    assert load_engine(tiny_model, num_slots=2, ctx=128, compile=False).prompt_lookup
