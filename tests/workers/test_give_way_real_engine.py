"""Give-way on the real engine (SmolLM2) through a real Redis: a long low-priority read is under
way when an equally long high-priority prompt arrives; the second gets its first token first,
and the first finishes from where it parked."""

from __future__ import annotations

import pytest
import redis

from engine import load_engine
from queues.claims import Claims
from queues.keys import Keys
from tests.helpers.queue import Submit
from tests.helpers.workers import MODEL, run_until_idle, spy_on_reads
from workers.loop import Worker

pytestmark = pytest.mark.smollm2


def test_a_long_read_gives_way_on_the_real_engine(redis_url):
    engine = load_engine(None, num_slots=2, ctx=1024, dtype="float32", threads=2, compile=False)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    worker = Worker(engine, Claims(client, MODEL, "real"), engine.tokenizer, prefill_chunk=64)
    spy_on_reads(worker)
    submit = Submit(redis_url)
    story = engine.tokenizer.encode("Once upon a time, in a quiet village by the sea, " * 60)[:600]
    submit("long-low", priority=0, prompt=story, max_tokens=3, temperature=0)
    worker.step()
    submit("long-high", priority=9, prompt=story[::-1], max_tokens=3, temperature=0)
    run_until_idle(worker)
    k = Keys(MODEL)
    low, high = client.hgetall(k.req("long-low")), client.hgetall(k.req("long-high"))
    assert int(high["first_token_ms"]) < int(low["first_token_ms"])
    assert (low["yields"], low["status"], high["status"]) == ("1", "finished", "finished")
    assert worker.read_log[:2] == [("long-low", 64), ("long-high", 64)]
    assert sum(n for rid, n in worker.read_log if rid == "long-low") == len(story)  # no recompute
    client.close()
