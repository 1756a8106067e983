"""The worker's pool places each slot's blocks as one run from its home (workers/blocks.py), so a
served batch's eager decode steps read the KV as one strided view of each pool, not a gather
(`Transformer.kv_view`), even when the slots take their blocks in turn, one step at a time; and
the answers are those of the same batch gathered from blocks placed without homes, bit for bit.
That view and that gather are the fallback of a pool engine/attend.cpp does not read (no C++
compiler, CUDA, fp8), forced here; the CPU's default reads every row in place, wherever its
blocks lie: placed or not, the same answers bit for bit too.""" 

from __future__ import annotations

import pytest
import redis

import workers.kv_pool

from engine.fake import FakeDecoder
from engine.model import KV_BLOCK
from queues.claims import Claims
from queues.keys import Keys
from tests.engine.test_kv_pool import pooled
from tests.helpers.queue import Submit
from tests.helpers.workers import MODEL, run_until_idle
from workers.blocks import BlockPool
from workers.loop import Worker

K = Keys(MODEL)
PROMPTS = {f"r{i}": [(7 * i + 3 * j) % 256 for j in range(20 + 9 * i)] for i in range(3)}
ANSWER = KV_BLOCK + 10  # every answer crosses into a block it takes while the others decode


def serve(redis_url: str, worker_id: str, requests: dict[str, list[int]],
          in_place: bool = False) -> list[tuple[int, int] | None]:
    """Serve the requests together; the kv_view of every decode step with all three rows."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    engine = pooled(kv_blocks=12)  # 3 slots: homes 0, 4, 8
    for block in engine.model.layers:
        block.mixer.in_place = in_place
    model, views = engine.model, []
    step_inputs = model.step_inputs

    def spied(index):
        inputs = step_inputs(index)
        if not index.reading and len(index.slots) == 3:
            views.append(inputs.kv_view)
        return inputs
    model.step_inputs = spied
    worker = Worker(engine, Claims(client, MODEL, worker_id), FakeDecoder(), prefill_chunk=KV_BLOCK)
    submit = Submit(redis_url)
    for rid, prompt in requests.items():
        submit(rid, prompt=prompt, max_tokens=ANSWER, temperature=0, logprobs=2)
    run_until_idle(worker)
    worker.stop()
    return views


def answer(client: redis.Redis, rid: str) -> list[dict]:
    return [f for _, f in client.xrange(K.out(rid)) if f["type"] == "token"]


def test_a_served_batch_decodes_through_one_view_with_the_gathers_answers(redis_url, monkeypatch: pytest.MonkeyPatch):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    placed = serve(redis_url, "placed", PROMPTS)
    assert len(placed) > ANSWER // 2  # the three decoded together most of the way
    assert set(placed) == {(0, 4 * KV_BLOCK)}  # rows at homes 0, 4, 8 blocks: one view every step
    with monkeypatch.context() as m:
        m.setattr(workers.kv_pool, "BlockPool", lambda tokens, block, slots: BlockPool(tokens, block))
        unplaced = serve(redis_url, "unplaced", {f"unplaced-{rid}": p for rid, p in PROMPTS.items()})
    # blocks 0, 1, 2 first (a view), then the second blocks taken in turn interleave: gathers
    assert unplaced.count(None) > ANSWER // 4 and set(unplaced) == {(0, KV_BLOCK), None}
    for rid in PROMPTS:
        tokens = answer(client, rid)
        assert len(tokens) == ANSWER and tokens == answer(client, f"unplaced-{rid}")  # logprobs too


def test_a_served_batch_read_in_place_answers_alike_wherever_its_blocks_lie(redis_url, monkeypatch: pytest.MonkeyPatch):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    placed = serve(redis_url, "placed", PROMPTS, in_place=True)
    assert len(placed) > ANSWER // 2 and set(placed) == {None}  # no view: each row read where it lies
    with monkeypatch.context() as m:
        m.setattr(workers.kv_pool, "BlockPool", lambda tokens, block, slots: BlockPool(tokens, block))
        serve(redis_url, "unplaced", {f"unplaced-{rid}": p for rid, p in PROMPTS.items()}, in_place=True)
    for rid in PROMPTS:
        tokens = answer(client, rid)
        assert len(tokens) == ANSWER and tokens == answer(client, f"unplaced-{rid}")
