"""lm-evaluation-harness (the real `lm-eval` package) against a live `strata serve` (issue 29):
a multiple-choice (loglikelihood) task and a generate_until task defined in tests/e2e/lm_eval_tasks
on a tiny local file, through lm-eval's `local-completions` model with its `remote` tokenizer
(Strata's /tokenize, /detokenize and /tokenizer_info). Its results equal the engine's own, computed
here in-process on the same default engine; then the same battery goes through /v1/batches at
priority -10 while an interactive stream at priority 0 is served ahead of the lines still waiting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from queues.batches import request_id
from queues.keys import Keys
from queues.server import free_port
from queues.settings import environ_without_settings
from tests.e2e.conftest import EAGER, MODEL, healthy, wait_until

pytestmark = pytest.mark.smollm2

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "e2e" / "lm_eval_tasks"
CHUNK = 64  # the server's prefill chunk and the in-process read's: the same rounding


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, redis.Redis]]:
    port, data = free_port(), tmp_path_factory.mktemp("lm-eval") / "data"
    env = {**environ_without_settings(), **EAGER, "STRATA_PREFILL_CHUNK": str(CHUNK)}
    serve = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(port), "--data-dir", str(data),
                              "--parallel", "2", "--threads", "2", "--ctx", "1024"], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(base), "the API", 180)
        wait_until(lambda: MODEL in [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]], "the model", 400)
        client = redis.Redis.from_url((data / "redis.url").read_text(), decode_responses=True)
        yield base, client
        client.close()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


@pytest.fixture(scope="module")
def engine():
    from engine import load_engine

    return load_engine(None, num_slots=1, ctx=1024, threads=2, compile=False, prompt_lookup=False)


def _loglikelihood(engine, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """What lm-eval computes from an echo + logprobs answer, straight from the engine."""
    from engine.protocol import SamplingParams

    ids = context + continuation
    engine.begin(0, SamplingParams(temperature=0.0, prompt_logprobs=1))
    for lo in range(0, len(ids), CHUNK):
        engine.read(0, ids[lo:lo + CHUNK], sample=False)
    scores = engine.prompt_logprobs(0)[len(context) - 1:]  # entry i scores token i + 1
    return sum(s.logprob for s in scores), all(s.top[0][0] == s.token for s in scores)


def _greedy(engine, context: list[int], max_tokens: int, until: str) -> str:
    from engine.protocol import SamplingParams

    engine.begin(0, SamplingParams(temperature=0.0))
    for lo in range(0, len(context), CHUNK):
        token = engine.read(0, context[lo:lo + CHUNK], sample=lo + CHUNK >= len(context))
    out = [token]
    while len(out) < max_tokens and out[-1] not in engine.eos_token_ids:
        out += engine.decode([0], [out[-1]])[0]
    text = engine.tokenizer.decode([t for t in out if t not in engine.eos_token_ids])
    return text.split(until)[0]


def _pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids (TemplateAPI._encode_pair)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def _run_lm_eval(base: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the tasks name their data file from the repository's root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return simple_evaluate(
        model="local-completions",
        model_args=f"base_url={base}/v1/completions,model={MODEL},tokenizer_backend=remote,num_concurrent=1,"
                   "max_retries=1,timeout=300",
        tasks=["strata_capitals_mc", "strata_capitals_gen"], task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )


def test_lm_eval_through_local_completions_equals_the_engine(served, engine, monkeypatch):
    base, _redis = served
    results = _run_lm_eval(base, monkeypatch)
    tokenizer = engine.tokenizer
    mc = results["samples"]["strata_capitals_mc"]
    assert len(mc) == 4
    for sample in mc:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            expected_ll, expected_greedy = _loglikelihood(engine, *_pair(tokenizer, context, continuation))
            got_ll, got_greedy = resp[0]
            assert got_ll == pytest.approx(expected_ll, abs=1e-5), (context, continuation)
            assert got_greedy == expected_greedy
    gen = results["samples"]["strata_capitals_gen"]
    assert len(gen) == 4
    for sample in gen:
        context, kwargs = sample["arguments"][0]
        ids = tokenizer.encode(context, add_special_tokens=False)
        assert sample["resps"][0][0] == _greedy(engine, ids, kwargs["max_gen_toks"], "\n"), context
    assert 0.0 <= results["results"]["strata_capitals_mc"]["acc,none"] <= 1.0


def _battery_lines(tokenizer, copies: int) -> list[dict]:
    """The loglikelihood requests lm-eval sends for the multiple-choice task, as batch lines."""
    docs = [json.loads(line) for line in (TASKS / "capitals.jsonl").read_text().splitlines()]
    lines = []
    for copy in range(copies):
        for d, doc in enumerate(docs):
            context = f"Question: What is the capital of {doc['country']}?\nAnswer:"
            for c, choice in enumerate(doc["choices"]):
                ctx, cont = _pair(tokenizer, context, choice)
                lines.append({"custom_id": f"{copy}-{d}-{c}", "method": "POST", "url": "/v1/completions",
                              "body": {"model": MODEL, "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1,
                                       "logprobs": 1, "echo": True, "seed": 1234},
                              "ctxlen": len(ctx)})
    return lines


def test_the_battery_through_batches_at_priority_minus_10_leaves_an_interactive_stream_its_place(served, engine):
    base, client = served
    keys = Keys(MODEL)
    http = httpx.Client(base_url=base, timeout=300)
    lines = _battery_lines(engine.tokenizer, copies=4)
    content = "".join(json.dumps({k: v for k, v in line.items() if k != "ctxlen"}) + "\n" for line in lines)
    uploaded = http.post("/v1/files", files={"file": ("battery.jsonl", content.encode())}, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    batch = http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions",
                                           "completion_window": "24h", "priority": -10}).json()
    assert batch["priority"] == -10

    def progress() -> int:
        return http.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"]

    wait_until(lambda: progress() >= 4, "the battery's first lines", 300)
    streamed = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Quick: say hi."}], "max_tokens": 4,
        "stream": True, "priority": 0})
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
    interactive = client.hgetall(keys.req(streamed.headers["x-request-id"]))
    wait_until(lambda: http.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed", "the battery", 600)
    records = [client.hgetall(keys.req(request_id(batch["id"], n))) for n in range(len(lines))]
    arrived = int(interactive["enqueued_ms"])
    waiting = [r for r in records if int(r["enqueued_ms"]) < arrived < int(r["claimed_ms"])]
    assert waiting, "no battery line was waiting when the stream arrived: the test means nothing"
    assert all(int(r["claim_seq"]) > int(interactive["claim_seq"]) for r in waiting)  # it went before them all

    done = http.get(f"/v1/batches/{batch['id']}").json()
    output = [json.loads(x) for x in http.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    for entry in output:
        line = by_id[entry["custom_id"]]
        ids = line["body"]["prompt"][0]
        token_logprobs = entry["response"]["body"]["choices"][0]["logprobs"]["token_logprobs"]
        expected, _greedy_too = _loglikelihood(engine, ids[:line["ctxlen"]], ids[line["ctxlen"]:])
        assert sum(token_logprobs[line["ctxlen"]:-1]) == pytest.approx(expected, abs=1e-5)
    http.close()
