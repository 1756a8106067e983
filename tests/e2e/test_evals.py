"""The evaluation battery's API end to end (issue 29): a real worker on the default engine
(the SmolLM2 GGUF in bf16, linears on its Q4_1 blocks, four slots, eager), a real API and Redis."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import MODEL, Stack, default_engine_stack, wait_until

pytestmark = pytest.mark.smollm2

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with default_engine_stack(tmp_path_factory.mktemp("evals-redis"), parallel=4, prefill_chunk=64) as stack:
        yield stack


def _answer_ids(stack: Stack, response: httpx.Response) -> list[int]:
    """The token ids the worker streamed for this answer (its Redis output stream)."""
    entries = stack.redis.xrange(stack.keys.out(response.headers["x-request-id"]))
    return [int(i) for _, fields in entries if fields.get("type") == "token" for i in fields["ids"].split(",") if i]


def _chat(stack: Stack, **body) -> httpx.Response:
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=120,
                          json={"messages": QUESTION, "max_tokens": 12, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response


def test_banned_tokens_never_appear_in_a_real_answer(stack: Stack):
    plain = _chat(stack)
    banned = sorted(set(_answer_ids(stack, plain)))
    assert banned
    biased = _chat(stack, logit_bias={str(t): -100 for t in banned})
    ids = _answer_ids(stack, biased)
    assert ids and not set(ids) & set(banned)
    assert biased.json()["choices"][0]["message"]["content"] != plain.json()["choices"][0]["message"]["content"]


def test_sampling_controls_are_bounded_at_the_door(stack: Stack):
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("min_p", 1.5), ("logit_bias", {"12": 101}), ("logit_bias", {"x": 1}),
                         ("logit_bias", {"999999": -100})]:
        response = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30,
                              json={"messages": QUESTION, field: value})
        assert response.status_code == 400, (field, value, response.text)
        assert response.json()["error"]["param"] == field, response.json()


# ---- logprobs, echo, token-id prompts ---------------------------------------------------------

# max |logprob - float32 logprob| allowed: docs/engine.md "Log-probabilities" (measured with
# bench/logprobs.py --precision: the default engine's step precision against the float32 engine)
LOGPROB_BOUND = 0.5


@pytest.fixture(scope="module")
def reference():
    """The float32 engine (the dequantized file), for teacher-forced log-softmax."""
    from engine import load_engine

    return load_engine(None, num_slots=1, ctx=1024, dtype="float32", threads=2, compile=False, prompt_lookup=False)


def _float32_logprobs(engine, ids: list[int]):
    """log_softmax of the float32 model's logits at every position of `ids`: row i scores ids[i + 1]."""
    import torch

    from engine.model import CacheIndex

    engine.begin(0, engine._samplers[0].params)
    index = CacheIndex.for_slots([0], torch.arange(len(ids)).unsqueeze(0), len(ids))
    with torch.inference_mode():
        logits = engine.model.logits(engine.model.forward_all(torch.tensor([ids]), index)[0])
    return torch.log_softmax(logits.float(), dim=-1)


def _tokenizer():
    from engine.files import resolve_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_model_path(resolve_model_path(None))


def test_greedy_logprobs_equal_the_float32_log_softmax_within_the_bound(stack: Stack, reference):
    response = _chat(stack, logprobs=True, top_logprobs=5, max_tokens=16)
    content = response.json()["choices"][0]["logprobs"]["content"]
    ids = _answer_ids(stack, response)
    assert len(content) == len(ids) > 0
    prompt = _tokenizer().encode_chat(QUESTION)
    expected = _float32_logprobs(reference, prompt + ids)
    for i, (entry, token) in enumerate(zip(content, ids)):
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and len(tops) == 5
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the sampled token is the top one
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert abs(entry["logprob"] - float(expected[len(prompt) - 1 + i, token])) <= LOGPROB_BOUND, i


def test_echo_with_logprobs_scores_the_prompt_like_a_float32_pass(stack: Stack, reference):
    text = "The capital of France is Paris. The capital of Italy is Rome."
    response = httpx.post(f"{stack.base_url}/v1/completions", timeout=120, json={
        "prompt": text, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    ids = _tokenizer().encode(text)
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert response.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == text and len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = _float32_logprobs(reference, ids)
    got = logprobs["token_logprobs"][1:]
    assert max(abs(g - float(expected[i, t])) for i, (g, t) in enumerate(zip(got, ids[1:]))) <= LOGPROB_BOUND
    # as token ids (lm-eval's default), streamed, with one answer token: the same prompt scores
    streamed = httpx.post(f"{stack.base_url}/v1/completions", timeout=120, json={
        "prompt": [ids], "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0, "stream": True})
    chunks = [c for c in _events(streamed.text) if c["choices"]]
    scored = [lp for c in chunks if c["choices"][0]["logprobs"] for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert scored[:len(ids)] == logprobs["token_logprobs"] and len(scored) == len(ids) + 1
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(text)


def _events(body: str) -> list[dict]:
    import json

    return [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def test_a_prompt_given_as_token_ids_answers_as_its_text_does(stack: Stack):
    text = "Once upon a time"
    ids = _tokenizer().encode(text)
    answers = []
    for prompt in (text, ids, [ids]):
        response = httpx.post(f"{stack.base_url}/v1/completions", timeout=120,
                              json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["text"])
    assert answers[0] == answers[1] == answers[2] and answers[0]
    for bad in ([ids, ids], [10**9], [[]]):
        response = httpx.post(f"{stack.base_url}/v1/completions", timeout=30, json={"prompt": bad})
        assert response.status_code == 400, (bad, response.text)


# ---- n answers ---------------------------------------------------------------------------------


def _worker_hash(stack: Stack) -> dict[str, str]:
    (wid,) = stack.redis.zrange(stack.keys.workers, 0, -1)
    return stack.redis.hgetall(stack.keys.worker(wid))


def _after_a_heartbeat(stack: Stack) -> dict[str, str]:
    """The worker hash once the worker has beaten again: its counters as of now (between beats the
    hash is republished only when the read in progress changes, so reads that began and ended
    within a step show at the next beat)."""
    beat = _worker_hash(stack).get("heartbeat_ms")
    wait_until(lambda: _worker_hash(stack).get("heartbeat_ms") != beat, "the worker's next heartbeat", 30)
    return _worker_hash(stack)


def test_n_answers_read_the_prompt_once_and_each_is_the_single_request_of_its_seed(stack: Stack):
    """The openai client, n=4 (the worker's four slots), seed 21, temperature 1: answer i is the
    answer of a single request with seed 21 + i; the worker read the prompt's tokens once."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name a colour and a fruit, n-test."}]  # no slot holds it yet
    before = int(_after_a_heartbeat(stack).get("prompt_tokens_read", 0))
    answered = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=21, n=4,
                                              temperature=1.0, logprobs=True)
    assert [c.index for c in answered.choices] == [0, 1, 2, 3]
    answers = [c.message.content for c in answered.choices]
    assert len(set(answers)) > 1
    assert answered.usage.completion_tokens == sum(len(c.logprobs.content) for c in answered.choices)
    assert int(_after_a_heartbeat(stack)["prompt_tokens_read"]) - before == answered.usage.prompt_tokens
    for i in range(4):
        # without logprobs: asking for them (exact rows reported) must not change what is sampled
        single = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=21 + i,
                                                temperature=1.0)
        assert single.choices[0].message.content == answers[i]
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=21, n=4, temperature=1.0,
                                           logprobs=True)
    assert [c.message.content for c in again.choices] == answers  # reproducible
