"""Recovery time after `kill -9` of a worker, end to end: `strata serve` with the default model,
one streaming client mid-answer, the worker holding its request killed; the time from the kill
to the client's next token. Two layouts: one worker (serve restarts it; the new process takes
back its dead predecessor's claims as soon as it is up, without waiting for the lease) and two
workers (the sibling takes them back at its next heartbeat).

    .venv/bin/python -m bench.recovery [--rounds 3] [--lease-ms 15000]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis
from rich.console import Console
from rich.table import Table

from engine.files import resolve_model_path, served_model_name
from queues.keys import Keys
from queues.server import free_port
from queues.settings import environ_without_settings

MODEL = served_model_name(resolve_model_path(None))
K = Keys(MODEL)


def wait(check, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.05)


def up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def measure(devices: str, rounds: int, lease_ms: int) -> list[float]:
    """Seconds from each kill to the client's next token."""
    data = Path(tempfile.mkdtemp(prefix="strata-recovery-"))
    port = free_port()
    env = environ_without_settings()
    serve = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(port), "--data-dir", str(data),
                              "--devices", devices, "--lease-ms", str(lease_ms)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    gaps = []
    try:
        wait(lambda: up(base) and (data / "redis.url").exists())
        client = redis.Redis.from_url((data / "redis.url").read_text(), decode_responses=True)
        workers = len(devices.split(","))
        for round_ in range(rounds):
            wait(lambda: client.zcard(K.workers) >= workers and len(client.zrangebyscore(
                K.workers, int(time.time() * 1000) - 3000, "+inf")) >= workers)
            token_times: list[float] = []
            request_id: list[str] = []

            def stream() -> None:
                with httpx.stream("POST", f"{base}/v1/completions", timeout=600, json={
                        "model": MODEL, "prompt": f"Recovery round {round_}: a long story.", "max_tokens": 200,
                        "ignore_eos": True, "temperature": 0, "stream": True}) as r:
                    request_id.append(r.headers["x-request-id"])
                    for line in r.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                            token_times.append(time.monotonic())

            reader = threading.Thread(target=stream)
            reader.start()
            wait(lambda: len(token_times) >= 20)
            owner = client.hget(K.req(request_id[0]), "worker")
            killed_at = time.monotonic()
            os.kill(int(owner.rsplit("-", 2)[1]), signal.SIGKILL)
            seen = len(token_times)
            wait(lambda: any(t > killed_at + 0.001 for t in token_times[seen:]) or not reader.is_alive())
            gaps.append(next(t for t in token_times if t > killed_at) - killed_at)
            reader.join()
        client.close()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(120)
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lease-ms", type=int, default=15_000)
    args = parser.parse_args()
    table = Table(title=f"kill -9 of the worker holding a streaming request → the client's next token "
                        f"(lease {args.lease_ms / 1000:g} s)")
    for column in ("workers", "each round (s)", "mean (s)"):
        table.add_column(column)
    for devices in ("cpu", "cpu,cpu"):
        gaps = measure(devices, args.rounds, args.lease_ms)
        print(f"{devices}: {gaps}", flush=True)
        table.add_row(str(len(devices.split(","))), ", ".join(f"{g:.1f}" for g in gaps), f"{sum(gaps) / len(gaps):.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
