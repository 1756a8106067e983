"""End to end: a real `strata worker` process and a real `strata api` process (uvicorn) on a
free port, a real Redis, and the real SmolLM2 file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass

import httpx
import pytest
import redis

from engine.files import resolve_model_path, served_model_name
from queues.keys import Keys, models_key
from queues.server import EmbeddedRedis, free_port
from tests import processes
from tests.helpers.http import sse  # noqa: F401 - the e2e tests take it from here

MODEL = served_model_name(resolve_model_path(None))


@dataclass
class Stack:
    base_url: str
    redis_url: str
    redis: redis.Redis
    worker: subprocess.Popen
    api: subprocess.Popen
    keys: Keys = Keys(MODEL)


# Workers whose tests are not about the compiled step decode eagerly: each would compile at start
# (seconds to tens of seconds on 2 loaded cores). test_serve_command runs the compiled default.
EAGER = {"STRATA_COMPILE": "0"}


def start(role: str, env: dict[str, str], *flags: str, **popen: object) -> subprocess.Popen:
    """`strata <role>` in a session of its own (tests/processes.py): stop() ends all it started."""
    return processes.spawn([sys.executable, "-m", "strata", role, *flags], env=env, **popen)


def stop(process: subprocess.Popen, timeout_s: float = 30) -> int | None:
    """SIGTERM, then SIGKILL to what is left of its session; its exit code (None: it was killed)."""
    return processes.stop(process, timeout_s)


def wait_until(check, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One slot, float32 (exact greedy answers), chunks of 64 tokens."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("e2e-redis"), appendonly=False).start()
    port = free_port()
    env = {**os.environ, "STRATA_REDIS_URL": server.url, "STRATA_PORT": str(port),
           "STRATA_PARALLEL": "1", "STRATA_DTYPE": "float32", "STRATA_PREFILL_CHUNK": "64",
           "STRATA_CTX": "2048", "STRATA_THREADS": "2", **EAGER}
    env.pop("REDIS_URL", None)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    started: list[subprocess.Popen] = []
    try:
        started += [start("worker", env), start("api", env)]
        stack = Stack(f"http://127.0.0.1:{port}", server.url, client, *started)
        wait_until(lambda: client.zscore(models_key(), MODEL) is not None, "the worker's heartbeat")
        wait_until(lambda: healthy(stack.base_url), "the API")
        yield stack
    finally:
        for process in reversed(started):
            stop(process)
        client.close()
        server.stop()


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def default_engine_stack(folder: Path, *, parallel: int, prefill_chunk: int,
                         model: Path | None = None) -> Iterator[Stack]:
    """A worker on the default engine (eager) and an API over their own Redis, stopped whatever
    fails; `model`: another model file or folder than the default SmolLM2 GGUF."""
    server = EmbeddedRedis(folder, appendonly=False).start()
    port = free_port()
    env = {**os.environ, "STRATA_REDIS_URL": server.url, "STRATA_PORT": str(port), "STRATA_PARALLEL": str(parallel),
           "STRATA_PREFILL_CHUNK": str(prefill_chunk), "STRATA_CTX": "1024", "STRATA_THREADS": "2", **EAGER}
    env.pop("REDIS_URL", None)
    env.pop("STRATA_DTYPE", None)  # the default engine
    if model is not None:
        env["STRATA_MODEL"] = str(model)
    name = MODEL if model is None else served_model_name(model)
    worker, api = start("worker", env), start("api", env)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    stack = Stack(f"http://127.0.0.1:{port}", server.url, client, worker, api, Keys(name))
    try:
        wait_until(lambda: client.zscore(models_key(), name) is not None, "the worker's heartbeat")
        wait_until(lambda: healthy(stack.base_url), "the API")
        yield stack
    finally:
        stop(api)
        stop(worker)
        client.close()
        server.stop()
