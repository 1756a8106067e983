"""engine/memory.py's hand-back of freed heap: a prompt read that ends deep in the context asks
glibc to return the pages its gathers and activations freed (a long read left ~150 MB in a
1.7B model's worker that decoding never reuses); shorter reads and chunks that sample nothing
do not pay for the trim."""

from __future__ import annotations

import pytest

from engine import runner
from engine.runner import TRIM_AFTER
from tests.helpers.tiny_engine import GREEDY, tiny_engine


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(runner, "release_freed_memory", lambda: calls.append(1))
    return calls


def test_a_read_ending_deep_hands_freed_memory_back_once(trims):
    engine = tiny_engine(num_slots=2, ctx=TRIM_AFTER + 64)
    engine.begin(0, GREEDY)
    tokens = [(3 * i) % 256 for i in range(TRIM_AFTER + 8)]
    for start in range(0, TRIM_AFTER, 256):  # chunks that sample nothing: no trim, however deep
        engine.read(0, tokens[start:start + 256], sample=False)
    assert trims == []
    engine.read(0, tokens[TRIM_AFTER:], sample=True)  # the read's last chunk, ending past TRIM_AFTER
    assert trims == [1]
    engine.decode([0], [5])
    assert trims == [1]  # decode steps never trim


def test_a_short_read_does_not_trim(trims):
    engine = tiny_engine(num_slots=2, ctx=TRIM_AFTER + 64)
    engine.begin(1, GREEDY)
    assert engine.read(1, [(5 * i) % 256 for i in range(TRIM_AFTER - 1)], sample=True) is not None
    assert trims == []

