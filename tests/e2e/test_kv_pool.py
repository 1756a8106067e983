"""The paged KV pool end to end: a real worker and API over a tiny random model (the default one
reads a 6 000-token prompt too slowly for a test), `--kv-tokens 8192 --max-model-len 8192`: a
6 000-token prompt served beside three short ones, what the worker hash publishes, and a prompt
beyond the context refused at the door naming both numbers."""

from __future__ import annotations

import concurrent.futures
import os

import httpx
import pytest
import redis

from queues.keys import Keys, models_key
from queues.server import EmbeddedRedis, free_port
from tests.e2e.conftest import EAGER, healthy, start, stop, wait_until

NAME = "tiny-pool"
K = Keys(NAME)


@pytest.fixture(scope="module")
def pooled_stack(tmp_path_factory, tiny_model):
    server = EmbeddedRedis(tmp_path_factory.mktemp("pool-redis"), appendonly=False).start()
    port = free_port()
    env = {**os.environ, "STRATA_REDIS_URL": server.url, "STRATA_PORT": str(port), "STRATA_MODEL": str(tiny_model),
           "STRATA_SERVED_MODEL_NAME": NAME, "STRATA_PARALLEL": "4", "STRATA_KV_TOKENS": "8192",
           "STRATA_MAX_MODEL_LEN": "8192", "STRATA_PREFILL_CHUNK": "512", "STRATA_THREADS": "2",
           "STRATA_DTYPE": "float32", **EAGER}
    env.pop("REDIS_URL", None)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    started = []
    try:
        started += [start("worker", env), start("api", env)]
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: client.zscore(models_key(), NAME) is not None, "the worker's heartbeat")
        wait_until(lambda: healthy(base), "the API")
        yield base, client
    finally:
        for process in reversed(started):
            stop(process)
        client.close()
        server.stop()


def complete(base: str, prompt: str, max_tokens: int) -> httpx.Response:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=300)


def test_a_6000_token_prompt_beside_three_short_ones_on_one_pool(pooled_stack):
    base, client = pooled_stack
    (wid,) = client.zrange(K.workers, 0, -1)
    published = client.hgetall(K.worker(wid))
    assert (published["ctx"], published["kv_block"], published["blocks_total"]) == ("8192", "64", "128")
    long_prompt = " ".join(["the"] * 6000)  # 6 000 tokens with SmolLM2's tokenizer
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(complete, base, long_prompt, 16)]
        jobs += [pool.submit(complete, base, f"Say {i} twice.", 16) for i in range(3)]
        answers = [job.result() for job in jobs]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    usage = answers[0].json()["usage"]
    assert usage["prompt_tokens"] == 6000 and usage["completion_tokens"] == 16
    assert all(a.json()["usage"]["completion_tokens"] == 16 for a in answers[1:])
    # once all ended (the next heartbeat): every block free again, the long prompt's still cached for a repeat
    wait_until(lambda: client.hget(K.worker(wid), "blocks_used") == "0", "the blocks given back")
    after = client.hgetall(K.worker(wid))
    assert after["blocks_free"] == "128" and int(after["blocks_cached"]) >= 6000 // 64


def test_a_prompt_beyond_the_context_is_refused_at_the_door_naming_both_numbers(pooled_stack):
    base, _client = pooled_stack
    r = complete(base, " ".join(["the"] * 8300), 4)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == ("This model's context is 8192 tokens; the prompt has 8300, which leaves no room "
                                "for an answer.")
