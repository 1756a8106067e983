"""`strata serve --engine fake --api-workers 2`: workers that load no weights and answer with the
fake engine's deterministic tokens on the wall clock, behind two real API replicas sharing one
port (they tokenize with the default model's tokenizer), Redis and the batch worker. What load
tests (bench/load.py) run against. A stream held by one replica is cancelled through the other,
and /metrics reads the same from both."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.fake import FakeDecoder, FakeEngine
from engine.files import default_model_path
from engine.protocol import SamplingParams
from engine.tokenizer import Tokenizer
from queues.server import free_port
from queues.settings import environ_without_settings
from tests.e2e.conftest import MODEL, healthy, sse, start, stop, wait_until

MESSAGES = [{"role": "user", "content": "Say hello."}]


def fake_answer(prompt: list[int], max_tokens: int, seed: int | None = None) -> str:
    """What the fake engine answers to `prompt`: its first token from the read, the rest decoded."""
    engine = FakeEngine(num_slots=1)
    engine.begin(0, SamplingParams(seed=seed))
    ids = [engine.read(0, prompt, sample=True)]
    while len(ids) < max_tokens:
        ids += engine.decode([0], ids[-1:])[0]
    return FakeDecoder().decode(ids)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    env = environ_without_settings()
    serve = start("serve", env, "--engine", "fake", "--port", str(port), "--data-dir",
                  str(tmp_path_factory.mktemp("fake-serve")), "--parallel", "2", "--fake-decode-ms-per-step", "2",
                  "--api-workers", "2")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(base), "the API", 120)
        wait_until(lambda: MODEL in [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]], "the worker", 60)
        yield base
    finally:
        assert stop(serve, 60) == 0


def test_a_chat_request_gets_the_fake_engines_deterministic_answer(served):
    prompt = Tokenizer.from_model_path(default_model_path()).encode_chat(MESSAGES)
    r = httpx.post(f"{served}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == fake_answer(prompt, 6, seed=3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6, "total_tokens": len(prompt) + 6}


def replica_of(client: httpx.Client) -> str:
    """Which API process holds this client's (kept-alive) connection."""
    r = client.get("/health")
    assert r.status_code == 200, r.text
    return r.headers["x-strata-replica"]


@pytest.fixture
def one_client_per_replica(served) -> Iterator[dict[str, httpx.Client]]:
    """Fresh connections until each replica holds one: the kernel hands each connection to
    whichever replica accepts it first."""
    clients: dict[str, httpx.Client] = {}
    spare: list[httpx.Client] = []
    try:
        for _ in range(200):
            client = httpx.Client(base_url=served, timeout=30)
            replica = replica_of(client)
            if replica in clients:
                spare.append(client)
            else:
                clients[replica] = client
            if len(clients) == 2:
                break
        assert len(clients) == 2, f"200 connections all went to {set(clients)}"
        yield clients
    finally:
        for client in [*clients.values(), *spare]:
            client.close()


def metric_lines(client: httpx.Client, prefix: str) -> list[str]:
    return sorted(line for line in client.get("/metrics").text.splitlines() if line.startswith(prefix))


def test_a_stream_on_one_replica_is_cancelled_through_the_other_and_both_count_it(one_client_per_replica):
    (holder, a), (other, b) = one_client_per_replica.items()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1500, "stream": True}
    with a.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["x-strata-replica"] == holder
        request_id = r.headers["x-request-id"]
        events = sse(r.iter_lines())
        assert "role" in next(events)["data"]  # the opening chunk
        assert '"content"' in next(events)["data"]  # a token: it runs on the worker
        cancelled = b.post(f"/v1/requests/{request_id}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        rest = [e["data"] for e in events]
    assert rest[-1] == "[DONE]" and '"cancelled"' in rest[-2], rest[-3:]
    assert len(rest) < 1500  # it stopped early
    status = b.get(f"/v1/requests/{request_id}").json()["status"]
    assert status == "cancelled"
    # /metrics reads Redis: both replicas answer the same numbers, the cancel counted once
    wait_until(lambda: metric_lines(a, "strata_requests_ended") == metric_lines(b, "strata_requests_ended"),
               "the same metrics from both replicas", 10)
    ended = metric_lines(a, "strata_requests_ended")
    assert any('status="cancelled"' in line and line.endswith(" 1.0") for line in ended), ended


def test_n_answers_through_the_openai_client_whole_and_streamed(served):
    """n=2 (both slots), seed 5: answer i is the fake engine's with seed 5 + i, under index i,
    chat and completions alike, whole and streamed; the prompt counts once in usage; n above
    the worker's slots is a 400 naming n."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=30)
    tokenizer = Tokenizer.from_model_path(default_model_path())
    chat_prompt, text_prompt = tokenizer.encode_chat(MESSAGES), tokenizer.encode("Once upon")
    expected = {kind: [fake_answer(p, 4, seed=5 + i) for i in range(2)]
                for kind, p in (("chat", chat_prompt), ("text", text_prompt))}
    assert expected["chat"][0] != expected["chat"][1]

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, seed=5, n=2)
    assert [(c.index, c.message.content, c.finish_reason) for c in chat.choices] == \
        [(i, expected["chat"][i], "length") for i in range(2)]
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(chat_prompt), 8)
    text = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, seed=5, n=2, logprobs=1)
    assert [(c.index, c.text) for c in text.choices] == [(i, expected["text"][i]) for i in range(2)]
    assert all(len(c.logprobs.tokens) == 4 for c in text.choices)

    streamed: dict[int, list[str]] = {0: [], 1: []}
    finished: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, seed=5, n=2,
                                                stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
        if chunk.usage:
            assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (len(chat_prompt), 8)
    assert ["".join(streamed[i]) for i in range(2)] == expected["chat"] and finished == {0: "length", 1: "length"}
    pieces: dict[int, list[str]] = {0: [], 1: []}
    for chunk in client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, seed=5, n=2, stream=True):
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
    assert ["".join(pieces[i]) for i in range(2)] == expected["text"]

    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=3)
    assert refused.value.body["param"] == "n"
