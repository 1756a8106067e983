"""begin(keep=n): a slot's cached prefix is reused, and the answer is the one a fresh read gives."""

from __future__ import annotations

from engine import SamplingParams, load_engine

GREEDY = SamplingParams(temperature=0)


def greedy(engine, slot: int, prompt: list[int], n: int, keep: int = 0) -> list[int]:
    engine.begin(slot, GREEDY, keep=keep)
    token = engine.read(slot, prompt[keep:], sample=True)
    out = [token]
    for _ in range(n - 1):
        out += engine.decode([slot], [token])[0]
        token = out[-1]
    return out


def test_a_kept_prefix_gives_the_same_answer_as_reading_it_again(tiny_model):
    engine = load_engine(tiny_model, num_slots=2, ctx=256, dtype="float32", threads=1, compile=False)
    first = list(range(100, 140))
    answer = greedy(engine, 0, first, 6)
    follow_up = first + answer + [7, 8, 9]
    held = len(first) + len(answer) - 1  # the last answer token was sampled, never fed
    assert engine.position(0) == held
    reused = greedy(engine, 0, follow_up, 8, keep=held)
    fresh = greedy(engine, 1, follow_up, 8)
    assert reused == fresh
