"""Prompt lookup (engine/lookup.py): a one-row decode step also checks a guessed token, and a
confirmed guess gives the tokens one step per token would, greedy or sampled. On the tiny random
model here (eager); test_compiled.py checks SmolLM2 through the packages."""

from __future__ import annotations

import pytest

from engine.lookup import Lookup
from engine.protocol import SamplingParams
from engine.runner import TorchEngine
from tests.engine.test_compiled import _tiny_engine


def test_the_guess_is_what_followed_the_longest_earlier_run():
    lookup = Lookup()
    assert lookup.guess(5) is None  # nothing held
    lookup.extend([5, 1, 2, 3, 9, 1, 2, 4, 7, 1])
    assert lookup.guess(2) == 4  # (1, 2) was followed by 3, then, latest, by 4
    assert lookup.guess(3) is None  # (1, 3) never occurred; a single token is not looked up
    lookup.extend([2])
    assert lookup.guess(3) == 9  # (1, 2, 3), the longest run that occurred, was followed by 9
    assert lookup.guess(4) == 7  # (7, 1, 2, 4)? never; (1, 2, 4) was followed by 7
    lookup.truncate(6)  # [5, 1, 2, 3, 9, 1]: what followed later is forgotten
    assert lookup.tokens == [5, 1, 2, 3, 9, 1] and lookup.guess(2) == 3
    lookup.truncate(0)
    assert lookup.guess(1) is None


def _generate(engine: TorchEngine, params: SamplingParams, prompt: list[int], length: int) -> tuple[list[int], int]:
    """Tokens from slot 1, and how many steps returned two."""
    engine.begin(1, params)
    out = [engine.read(1, prompt, sample=True)]
    two = 0
    while len(out) < length:
        [new] = engine.decode([1], [out[-1]])
        two += len(new) == 2
        out += new
    return out[:length], two


# a prompt that repeats itself, so some guesses come right; long enough to cross the 256 span
PROMPT = [(i * 7) % 23 + 3 for i in range(40)] * 5


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=11),
                                    SamplingParams(temperature=0.6, top_k=20, seed=5)],
                         ids=["greedy", "top_p", "top_k"])
def test_confirmed_guesses_give_the_tokens_of_one_step_each(params):
    plain = _tiny_engine()
    guessing = _tiny_engine()
    guessing.use_prompt_lookup()
    want, none = _generate(plain, params, PROMPT, 150)
    got, two = _generate(guessing, params, PROMPT, 150)
    assert none == 0 and two >= 3, two
    assert got == want
    # and a slot taken over by the next request starts its guesses from its own tokens
    again, _ = _generate(guessing, params, PROMPT[:60], 40)
    assert again == _generate(plain, params, PROMPT[:60], 40)[0]


def test_end_of_text_stays_masked_until_min_tokens_across_a_two_token_step():
    engine = _tiny_engine()
    engine.use_prompt_lookup()
    plain = _tiny_engine()
    first, _ = _generate(plain, SamplingParams(temperature=0.0), PROMPT, 60)
    eos = first[30]  # a token the free run produces: made end-of-text, masked for 40 tokens
    for e in (engine, plain):
        e.eos_token_ids = frozenset({eos})
    params = SamplingParams(temperature=0.0, min_tokens=40)
    got, two = _generate(engine, params, PROMPT, 60)
    want, _ = _generate(plain, params, PROMPT, 60)
    assert got == want and eos not in got[:40] and two > 0


def test_a_guess_never_fills_the_slot():
    """A full slot ends its request, so a step's second row must not take the last position: with
    a guess at every step, the last step with two rows starts 3 positions before ctx."""
    engine = _tiny_engine()
    engine.use_prompt_lookup()
    engine._lookups[0].guess = lambda last: 7  # always a guess (right or not)
    steps: list[list[int]] = []  # each model step's positions
    step = engine._step
    engine._step = lambda slots, tokens, positions: steps.append(positions) or step(slots, tokens, positions)
    engine.begin(0, SamplingParams(temperature=0.0))
    token = engine.read(0, PROMPT[: engine.ctx - 6], sample=True)
    while engine.position(0) < engine.ctx:
        token = engine.decode([0], [token])[0][-1]
    two = [p for p in steps if len(p) == 2]
    assert two and two[-1][0] + 2 < engine.ctx  # its two rows written and one position still free
    assert max(p[-1] for p in steps) == engine.ctx - 1
    assert all(len(p) == 1 for p in steps if p[0] + 2 >= engine.ctx)


def test_only_where_rows_do_not_depend_on_their_neighbours_and_two_rows_fit():
    engine = _tiny_engine()
    engine.device = type(engine.device)("cuda", 0)  # as a GPU engine would say
    with pytest.raises(ValueError, match="the CPU"):
        engine.use_prompt_lookup()
    # one slot: its compiled steps take one row (a one-row package only)
    with pytest.raises(ValueError, match="two slots"):
        _tiny_engine(num_slots=1).use_prompt_lookup()


def test_a_one_slot_engine_loads_without_lookup(tiny_model):
    from engine.runner import load_engine

    engine = load_engine(tiny_model, num_slots=1, ctx=128, compile=False)
    assert not engine.prompt_lookup
    assert load_engine(tiny_model, num_slots=2, ctx=128, compile=False).prompt_lookup
