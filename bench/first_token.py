"""Seconds from `strata serve` to the first token on a fresh data folder, and until the compiled
decode step takes over (issue 24.3).

    .venv/bin/python -m bench.first_token [--parallel 4] [--runs 1] [--keep DIR] [-- extra strata serve flags]

Each run starts `strata serve` (the defaults: the compiled step built in the background) on an
empty data folder, sends one greedy streaming chat request as soon as the API answers, and
reports, from the process's start: the API up, /v1/models listing the model, the first token, the
answer's end, and the worker hash saying `decode_step=compiled` (the packages took over). After
the switch the same request is sent again (it now decodes compiled), and both answers are
printed: a request begun before the switch decodes eagerly to its end; one begun after it is the
compiled step's (equal unless a near-tie parts them, docs/engine.md). `--keep DIR` copies the
last run's data folder there. Install time is not counted: `make install` first.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

from queues.keys import Keys
from queues.server import free_port
from queues.settings import environ_without_settings

PROMPT = "What is the capital of France? Answer in one sentence."


def answer(base: str, model: str, tokens: int) -> tuple[float, float, str]:
    """(first token, end) as time.monotonic(), and the text, of one greedy streaming request."""
    first, text = None, []
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
            if delta:
                first = first or time.monotonic()
                text.append(delta)
    return first or time.monotonic(), time.monotonic(), "".join(text)


def until(check, timeout_s: float, poll_s: float = 0.05) -> float:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return time.monotonic()
        except (httpx.HTTPError, redis.RedisError, OSError, ValueError, KeyError):
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"not within {timeout_s} s")


def run(data: Path, parallel: int, tokens: int, extra: list[str], timeout_s: float) -> dict[str, object]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (data.parent / f"{data.name}.log").open("wb")
    started = time.monotonic()
    serve = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(port), "--data-dir", str(data),
                              "--parallel", str(parallel), *extra], env=environ_without_settings(), stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        api = until(lambda: httpx.get(f"{base}/health", timeout=1).status_code in (200, 503), timeout_s)
        listed = until(lambda: httpx.get(f"{base}/v1/models", timeout=1).json()["data"], timeout_s)
        model = httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        first, end, before = answer(base, model, tokens)
        client = redis.Redis.from_url((data / "redis.url").read_text(), decode_responses=True)
        keys = Keys(model)
        compiling = [h.get("compile_progress") for w in client.zrange(keys.workers, 0, -1)
                     for h in [client.hgetall(keys.worker(w))] if h.get("decode_step") == "compiling"]
        switched = until(lambda: all(client.hget(keys.worker(w), "decode_step") == "compiled"
                                     for w in client.zrange(keys.workers, 0, -1)) and client.zcard(keys.workers) > 0,
                         timeout_s, poll_s=0.5)
        _, _, after = answer(base, model, tokens)
        client.close()
        return {"api up s": api - started, "model listed s": listed - started, "first token s": first - started,
                "answer end s": end - started, "compiling at first answer (%)": compiling,
                "compiled step took over s": switched - started, "answer before switch": before,
                "answer after switch": after, "same answer": before == after}
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--keep", type=Path, help="leave the last run's data folder here")
    parser.add_argument("extra", nargs="*", help="after --: more strata serve flags")
    args = parser.parse_args()
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="strata-first-token-") as scratch:
            data = Path(scratch) / "data"
            result = run(data, args.parallel, args.tokens, args.extra, args.timeout_s)
            print(json.dumps({"run": i + 1, **{k: round(v, 2) if isinstance(v, float) else v
                                             for k, v in result.items()}}, ensure_ascii=False), flush=True)
            if args.keep is not None and i == args.runs - 1:
                import shutil

                shutil.rmtree(args.keep, ignore_errors=True)
                shutil.copytree(data, args.keep)


if __name__ == "__main__":
    main()
