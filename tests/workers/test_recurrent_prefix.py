"""A recurrent model (Qwen3-Next: engine `rewinds` False) reuses no cached prefix: neither the KV
pool's shared blocks nor the slot's own conversation cache, since its per-slot state cannot be
cut back to where a prefix ends (docs/engine.md, "Recurrent state"). Fake engine, real Redis."""

from __future__ import annotations

import pytest

from queues.keys import Keys
from tests.helpers.queue import distinct_prompt
from tests.helpers.workers import MODEL, make_worker, run_until_idle

K = Keys(MODEL)


def _second_read(redis_client, submit, *, rewinds: bool, **engine_kw):
    header = distinct_prompt("header", 64)
    submit("first", prompt=header + [7, 8, 9], max_tokens=3)
    worker = make_worker(redis_client, slots=1, chunk=16, **engine_kw)
    worker.engine.rewinds = rewinds
    run_until_idle(worker)
    submit("second", prompt=header + [1, 2], max_tokens=3)
    worker.read_log.clear()
    run_until_idle(worker)
    return sum(n for rid, n in worker.read_log if rid == "second"), redis_client.hget(K.req("second"), "cached_tokens")


POOL = dict(kv_tokens=512, kv_block=16)


@pytest.mark.parametrize("rewinds, read", [(True, (2, "64")), (False, (66, "0"))])
def test_the_pools_shared_prefix_is_reused_only_by_a_model_that_rewinds(redis_client, submit, rewinds, read):
    assert _second_read(redis_client, submit, rewinds=rewinds, **POOL) == read


@pytest.mark.parametrize("rewinds, read", [(True, 2), (False, 66)])
def test_the_slots_own_conversation_cache_likewise(redis_client, submit, rewinds, read):
    assert _second_read(redis_client, submit, rewinds=rewinds)[0] == read
