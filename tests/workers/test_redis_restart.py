"""Redis restarts under a working worker: the worker drops what it cannot vouch for, and once Redis
is back the request resumes after the tokens its stream really holds (append-only file kept)."""

from __future__ import annotations

import redis

from queues.keys import Keys
from queues.server import EmbeddedRedis
from tests.helpers.queue import Submit, distinct_prompt
from tests.helpers.workers import MODEL, make_worker, run_until_idle


def tokens(client: redis.Redis, rid: str) -> list[str]:
    return [f["ids"] for _, f in client.xrange(Keys(MODEL).out(rid)) if f["type"] == "token"]


def test_a_request_survives_a_redis_restart(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", appendonly=True).start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    submit = Submit(server.url)
    prompt = distinct_prompt("restart", 6)
    try:
        submit("ref", prompt=prompt, max_tokens=20)
        run_until_idle(make_worker(client, slots=1, worker_id="ref"))
        submit("a", prompt=prompt, max_tokens=20)
        worker = make_worker(client, slots=1)
        for _ in range(6):
            assert worker.turn()
        before = tokens(client, "a")
        assert len(before) == 6

        port = server.port
        server.stop()  # SIGTERM: the append-only file is flushed
        assert worker.turn() is False and not worker.redis_up
        assert worker.slots[0].is_free  # dropped: nothing it cannot vouch for
        assert worker.turn() is False  # still down: keeps waiting, no crash

        server = EmbeddedRedis(tmp_path / "redis", port=port, appendonly=True).start()
        assert tokens(client, "a") == before  # what was streamed survived the restart
        worker.engine.clock.advance(5_000)  # the lease runs out
        run_until_idle(worker)
        assert tokens(client, "a") == tokens(client, "ref")  # continued, nothing repeated or lost
        record = client.hgetall(Keys(MODEL).req("a"))
        assert (record["status"], record["attempts"], record["completion_tokens"]) == ("finished", "2", "20")
    finally:
        client.close()
        server.stop()
