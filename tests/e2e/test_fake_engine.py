"""`strata serve --engine fake`: workers that load no weights and answer with the fake engine's
deterministic tokens on the wall clock, behind the real API (which tokenizes with the default
model's tokenizer), Redis and batch worker. What load tests (bench/load.py) run against."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from engine.fake import FakeDecoder, FakeEngine
from engine.files import default_model_path
from engine.protocol import SamplingParams
from engine.tokenizer import Tokenizer
from queues.server import free_port
from tests.e2e.conftest import MODEL, healthy, wait_until

MESSAGES = [{"role": "user", "content": "Say hello."}]


def fake_answer(prompt: list[int], max_tokens: int, seed: int | None = None) -> str:
    """What the fake engine answers to `prompt`: its first token from the read, the rest decoded."""
    engine = FakeEngine(num_slots=1)
    engine.begin(0, SamplingParams(seed=seed))
    ids = [engine.read(0, prompt, sample=True)]
    while len(ids) < max_tokens:
        ids += engine.decode([0], ids[-1:])
    return FakeDecoder().decode(ids)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_") and k != "REDIS_URL"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "strata", "serve", "--engine", "fake", "--port", str(port),
         "--data-dir", str(tmp_path_factory.mktemp("fake-serve")), "--parallel", "2",
         "--fake-decode-ms-per-step", "2"],
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(base), "the API", 120)
        wait_until(lambda: MODEL in [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]], "the worker", 60)
        yield base
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0


def test_a_chat_request_gets_the_fake_engines_deterministic_answer(served):
    prompt = Tokenizer.from_model_path(default_model_path()).encode_chat(MESSAGES)
    r = httpx.post(f"{served}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == fake_answer(prompt, 6, seed=3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6, "total_tokens": len(prompt) + 6}
