"""`strata queues` (the real command, as a process) on a known backlog."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.workers import make_worker


def run_queues(*args: str, env: dict[str, str] | None = None) -> str:
    env = {**os.environ, "COLUMNS": "200", **(env or {})}
    env.pop("REDIS_URL", None)
    done = subprocess.run([sys.executable, "-m", "strata", "queues", *args], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_backlog_in_service_order_and_the_workers_read(redis_url, redis_client, submit):
    submit("long-read", priority=2, prompt_len=400, max_tokens=2)
    worker = make_worker(redis_client, slots=2, chunk=100, worker_id="gpu0-worker")
    worker.step()  # long-read is on the lines, 100 of 400 read
    worker.step()
    for rid, priority, length in [("battery-1", -10, 30), ("alert", 9, 12), ("agent", 0, 50), ("battery-2", -10, 31)]:
        submit(rid, priority=priority, prompt_len=length)
    worker.membership.set_idle(False, worker.clock())
    worker.upkeep.run(worker.clock(), worker.describe())
    out = run_queues("--redis-url", redis_url)
    lines = out.splitlines()
    order = [rid for line in lines for rid in ("alert", "agent", "battery-1", "battery-2") if f" {rid} " in line]
    # the free slot was taken by the head (alert) at the second step? No: it was claimed before they came
    assert order == ["alert", "agent", "battery-1", "battery-2"]
    alert = next(line for line in lines if " alert " in line)
    assert " 9 " in alert and " 12 " in alert
    assert "fake: 4 waiting, 1 running" in out
    worker_line = next(line for line in lines if "gpu0-worker" in line)
    assert "1/2" in worker_line and "long-read" in worker_line and "200/400" in worker_line


def test_it_finds_the_embedded_redis_of_a_running_serve(redis_url, redis_client, submit, tmp_path):
    (tmp_path / "redis.url").write_text(redis_url)
    submit("only", priority=1)
    idle = make_worker(redis_client, slots=0)
    idle.upkeep.run(0, idle.describe())
    out = run_queues(env={"STRATA_DATA_DIR": str(tmp_path)})
    assert "fake: 1 waiting, 0 running" in out and " only " in out


def test_without_any_redis_it_says_where_it_looked(tmp_path):
    env = {**os.environ, "STRATA_DATA_DIR": str(tmp_path)}
    env.pop("REDIS_URL", None)
    done = subprocess.run([sys.executable, "-m", "strata", "queues"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "no REDIS_URL" in done.stderr


def test_a_workers_reserved_slots_show(redis_url, redis_client, submit):
    from workers.scheduler import Policy, Reserve

    submit("alert", priority=10, prompt_len=12, max_tokens=20)
    worker = make_worker(redis_client, slots=3, worker_id="gpu1-worker", policy=Policy(reserve=(Reserve(2, 10),)))
    submit("x", priority=0, prompt_len=12, max_tokens=20)
    submit("y", priority=0, prompt_len=12, max_tokens=20)
    worker.step()  # alert takes slot 0 (unreserved first), x waits: slots 1, 2 are kept for >= 10
    worker.upkeep.run(worker.clock(), worker.describe())
    worker_line = next(line for line in run_queues("--redis-url", redis_url).splitlines() if "gpu1-worker" in line)
    assert "0/2 (1:>=10 2:>=10)" in worker_line and "1/3" in worker_line


def test_a_workers_kv_pool_shows_in_its_row():
    from queues.worker_state import WorkerState
    from strata.queues_view import kv_blocks

    assert kv_blocks(WorkerState()) == "-"  # no pool published
    pooled = WorkerState(blocks_total=128, blocks_free=40, blocks_cached=12, blocks_shared=3)
    assert kv_blocks(pooled) == "40/128 free, 12 cached, 3 shared"
    waiting = WorkerState(blocks_total=8, blocks_free=3, waits_for_memory="urgent", blocks_short=3)
    assert kv_blocks(waiting) == "3/8 free, 0 cached, 0 shared; urgent waits for 3 more"
