"""The default engine (bf16, int4 decode and the bf16 copy for prompts, or on AVX2 alone `mm` and
float32 slabs of the file's blocks; int8 head) gives a greedy
request the same tokens however its text reached the cache: read cold or after a cached prefix,
in chunks of any block-aligned size, alone or beside other rows, resumed after some of its answer
with the answer replayed, and with one thread or two. Token for token, not within a tolerance:
a worker that takes a request over, or a slot that finds its prompt cached, must continue it as
the undisturbed run would.

Kept small (a prompt of one whole block and a partial one, ~100 tokens; 8 answer tokens) on the
session's default engine (tests/engine/conftest.py `smollm2_default`, shared with other modules):
each case still compares the whole KV cache bit for bit where its prompt is read, and the answer
token for token."""

from __future__ import annotations

import pytest
import torch

from engine.model import KV_BUCKET, PROMPT_BLOCK
from engine.protocol import SamplingParams
from tests.engine.conftest import q4_forms

pytestmark = pytest.mark.smollm2

GREEDY = SamplingParams(temperature=0.0)
ANSWER = 8


def _prompt(tok) -> list[int]:
    """A chat prompt of more than one block, so it has a whole block and a partial one."""
    ids = tok.encode_chat([
        {"role": "user", "content": "Here is a story. " + " ".join(f"Day {i}: the river rose and fell." for i in range(4))},
        {"role": "assistant", "content": "I read it."},
        {"role": "user", "content": "What happened on day 2? Answer in one sentence."},
    ])
    assert len(ids) > PROMPT_BLOCK and len(ids) % PROMPT_BLOCK, len(ids)
    return ids


def _read(engine, slot: int, ids: list[int], chunk: int, keep: int = 0) -> int:
    engine.begin(slot, GREEDY, keep=keep)
    pos, token = keep, None
    while pos < len(ids):
        token = engine.read(slot, ids[pos:pos + chunk], sample=pos + chunk >= len(ids))
        pos += chunk
    return token


def _continue(engine, slot: int, first: int, n: int = ANSWER) -> list[int]:
    out = [first]
    while len(out) < n:
        out += engine.decode([slot], [out[-1]])[0]
    return out[:n]


def _kv(engine, slot: int, n: int) -> torch.Tensor:
    return engine.model.slot_kv(slot, n)


@pytest.fixture(scope="module")
def engine(smollm2_default):
    engine = smollm2_default  # 4 slots, ctx 512; every case begins the slots it uses
    assert engine.model.forms == q4_forms(120)
    assert not engine.prompt_lookup and engine.compiled is None  # one token a step, eager, as below
    return engine


@pytest.fixture(scope="module")
def undisturbed(engine, smollm2):
    ids = _prompt(smollm2.tokenizer)
    first = _read(engine, 0, ids, chunk=256)
    kv = _kv(engine, 0, len(ids)).clone()
    return ids, kv, _continue(engine, 0, first)


def test_chunks_of_any_block_multiple_give_the_same_cache_and_answer(engine, undisturbed):
    ids, kv, answer = undisturbed
    for chunk in (PROMPT_BLOCK,):
        first = _read(engine, 1, ids, chunk)
        assert torch.equal(_kv(engine, 1, len(ids)), kv), chunk
        assert _continue(engine, 1, first) == answer, chunk


def test_a_cached_prefix_then_the_rest_gives_the_same_answer(engine, undisturbed):
    # the slot holds the prompt (read before); a repeat keeps its whole blocks and reads the rest
    # (the worker's rule: whole blocks of what it shares), 1..63 tokens through the bf16 copy too
    ids, kv, answer = undisturbed
    _read(engine, 1, ids, 256)
    keep = (len(ids) - 1) // PROMPT_BLOCK * PROMPT_BLOCK
    first = _read(engine, 1, ids, 256, keep=keep)
    assert torch.equal(_kv(engine, 1, len(ids)), kv)
    assert _continue(engine, 1, first) == answer


def test_beside_other_rows_the_answer_is_the_same(engine, undisturbed, smollm2):
    # slot 2 decodes beside slot 1 past position 256 (another attention span bucket), then alone
    ids, _, answer = undisturbed
    other = _prompt(smollm2.tokenizer) * 3
    out = [_read(engine, 1, ids, 256)]
    neighbour = [_read(engine, 2, other[:KV_BUCKET + 2], 256)]
    while len(out) < ANSWER:
        if len(out) % 3:  # two steps in three beside it, in scattered order (a gather)
            theirs, mine = engine.decode([2, 1], [neighbour[-1], out[-1]])
            neighbour += theirs
            out += mine
        else:
            out += engine.decode([1], [out[-1]])[0]
    assert out[:ANSWER] == answer


def test_a_resumed_request_replays_its_answer_and_goes_on_as_before(engine, undisturbed):
    # another slot (another worker) gets the prompt and the first k tokens of the answer: the
    # prompt is read, the answer replayed as decode rows (5: a step of 4 rows, the slots' count,
    # then one of 1), and the rest is the undisturbed answer
    ids, _, answer = undisturbed
    assert engine.num_slots == 4
    for k in (1, 5):
        engine.begin(1, GREEDY)
        assert engine.read(1, ids, sample=False) is None
        nxt = engine.replay(1, answer[:k], sample=True)
        assert engine.position(1) == len(ids) + k
        assert _continue(engine, 1, nxt, ANSWER - k) == answer[k:], k


def test_one_thread_or_two_the_same_answer(engine, undisturbed):
    ids, kv, answer = undisturbed
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        first = _read(engine, 1, ids, 256)
        assert torch.equal(_kv(engine, 1, len(ids)), kv)
        assert _continue(engine, 1, first) == answer
    finally:
        torch.set_num_threads(threads)
