"""Two requests with one new prefix arriving together, on the real engine (a tiny random float32
model) through a real Redis: the second adopts the blocks the first's read computed when it takes
the lines (workers/blocks.py `catch_up`), begins again from there and reads only its question;
its tokens, logprobs and top 5 are a cold run's, exactly."""

from __future__ import annotations

import redis

from engine.fake import FakeDecoder
from engine.model import KV_BLOCK
from queues.claims import Claims
from queues.keys import Keys
from tests.engine.test_kv_pool import pooled
from tests.helpers.queue import Submit
from tests.helpers.workers import MODEL, run_until_idle, spy_on_reads
from workers.loop import Worker

K = Keys(MODEL)
HEADER = [(5 * i + 3) % 256 for i in range(2 * KV_BLOCK)]
PROMPTS = {"a": HEADER + [9, 8, 7], "b": HEADER + [1, 2, 3, 4]}


def serve(redis_url: str, worker_id: str, requests: dict[str, list[int]]) -> Worker:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    worker = Worker(pooled(kv_blocks=12), Claims(client, MODEL, worker_id), FakeDecoder(), prefill_chunk=KV_BLOCK)
    spy_on_reads(worker)
    submit = Submit(redis_url)
    for rid, prompt in requests.items():  # a ends with its first token: b then decodes alone, as its cold run
        submit(rid, prompt=prompt, max_tokens=1 if rid == "a" else 6, temperature=0, logprobs=5)
    run_until_idle(worker)
    worker.stop()
    return worker


def answer(client: redis.Redis, rid: str) -> list[dict]:
    return [f for _, f in client.xrange(K.out(rid)) if f["type"] == "token"]


def test_the_second_of_two_reads_of_a_new_prefix_reads_only_its_question_and_gets_the_cold_run(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    serve(redis_url, "cold", {"cold-b": PROMPTS["b"]})
    worker = serve(redis_url, "warm", PROMPTS)
    assert worker.read_log == [("a", KV_BLOCK), ("a", KV_BLOCK), ("a", 3), ("b", 4)]
    assert client.hget(K.req("b"), "cached_tokens") == str(len(HEADER))
    assert answer(client, "b") == answer(client, "cold-b")  # tokens, logprobs and top 5
    assert len(answer(client, "b")) == 6
