"""One-token requests per second through the whole stack (issue 29 item 6): an evaluation
battery's scoring requests have short prompts and one token to generate. `strata serve --engine
fake` (64 slots, 1 ms decode steps, the fake engine's read cost per token), HTTP clients posting
`/v1/completions` with `max_tokens: 1` as fast as answers come back, for --seconds after a warm-up.

A second measure, `worker`, takes HTTP out: --requests one-token requests enqueued at once
through the API's own path (Intake) into an embedded Redis, then the real worker loop (the fake
engine on the wall clock, same costs) serves them all: requests/s of the worker alone.

With --baseline REPO (a checkout of an earlier commit, e.g. `git worktree add /tmp/base <commit>`)
each measure runs first against that checkout (its `strata serve`, its worker loop: started from
its folder, which `python -m` / `-c` put first on the path), then against this one, one after the
other in one run: the ratio is this run's.

    .venv/bin/python -m bench.short_requests [--baseline /tmp/base] [--only stack,worker]
        [--seconds 15] [--clients 64] [--api-workers 1] [--parallel 64] [--requests 3000]
        [--client aiohttp|httpx] [--access-log on|off]

Every result line carries the machine's load average: the cores are shared. Where the time goes
is measured as CPU time, which a loaded machine does not inflate the way it does wall time: for the
stack, each process's CPU milliseconds per answered request (the API, the worker, Redis, `strata
serve` itself, and this client) over the whole run; two cores can answer at most 2000 / (their
sum) requests a second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from bench.load import served
from queues.settings import environ_without_settings


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_seconds(serve_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of `strata serve` and each of its children, by role,
    and of this process (the client)."""
    out: dict[str, float] = {}
    root = psutil.Process(serve_pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            line = " ".join(proc.cmdline())
            times = proc.cpu_times()
        except psutil.Error:
            continue
        role = ("serve" if proc.pid == serve_pid else "redis" if "redis" in line or "valkey" in line
                else "api" if " api" in line else "worker" if " worker" in line else "other")
        out[role] = out.get(role, 0.0) + times.user + times.system
    me = psutil.Process().cpu_times()
    out["client"] = me.user + me.system
    return out


def cpu_per_request(before: dict[str, float], after: dict[str, float], answered: int) -> str:
    spent = {role: 1000 * (after[role] - before.get(role, 0.0)) / max(answered, 1) for role in after}
    shown = ", ".join(f"{role} {ms:.2f}" for role, ms in sorted(spent.items(), key=lambda kv: -kv[1]))
    return f"CPU ms per answered request: {shown}; total {sum(spent.values()):.2f}"


async def measure(base: str, clients: int, seconds: float, warm_s: float, client_kind: str = "httpx",
                  ) -> tuple[float, int, int]:
    """(answers per second over `seconds` after `warm_s`, failures, answers in all). `client_kind`:
    httpx, or aiohttp (a third of httpx's CPU a request here: the client shares the cores)."""
    if client_kind == "aiohttp":
        return await _measure_aiohttp(base, clients, seconds, warm_s)
    done: list[float] = []
    failures = 0
    stop_at = time.monotonic() + warm_s + seconds
    body = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures
        while time.monotonic() < stop_at:
            try:
                r = await http.post("/v1/completions", json=body)
            except httpx.TransportError:
                failures += 1
                continue
            if r.status_code == 200:
                done.append(time.monotonic())
            else:
                failures += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
        start = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(clients)))
    counted = [t for t in done if start + warm_s <= t <= start + warm_s + seconds]
    return len(counted) / seconds, failures, len(done)


async def _measure_aiohttp(base: str, clients: int, seconds: float, warm_s: float) -> tuple[float, int, int]:
    import aiohttp

    done: list[float] = []
    failures = 0
    stop_at = time.monotonic() + warm_s + seconds
    body = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal failures
        while time.monotonic() < stop_at:
            try:
                async with http.post(f"{base}/v1/completions", json=body) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                done.append(time.monotonic())
            else:
                failures += 1

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        start = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(clients)))
    counted = [t for t in done if start + warm_s <= t <= start + warm_s + seconds]
    return len(counted) / seconds, failures, len(done)


# Run in a child started from the checkout measured: only what both old and new loops share.
WORKER_ONLY = """
import asyncio, pathlib, sys, tempfile, time
import redis, redis.asyncio as aioredis
from engine.fake_live import live_fake_engine
from queues.claims import Claims
from queues.intake import Intake
from queues.records import QueuedRequest
from queues.server import EmbeddedRedis
from workers.loop import Worker
count, slots = int(sys.argv[1]), int(sys.argv[2])
server = EmbeddedRedis(pathlib.Path(tempfile.mkdtemp(prefix="strata-short-")), appendonly=False).start()
async def fill():
    client = aioredis.Redis.from_url(server.url)
    intake = Intake(client, "fake")
    for i in range(count):
        await intake.enqueue(QueuedRequest(id=f"r{i}", priority=0, prompt=[11, 12, 13, 14 + i % 50], max_tokens=1))
    await client.aclose()
asyncio.run(fill())
client = redis.Redis.from_url(server.url)
engine = live_fake_engine(slots, 2048, 0.05, 1.0)
worker = Worker(engine, Claims(client, "fake", "bench"), engine.tokenizer, prefill_chunk=256)
started = time.monotonic()
while client.zcard(worker.claims.keys.waiting) or any(s.request for s in worker.slots):
    worker.step()
print(count / (time.monotonic() - started))
server.stop()
"""


def worker_rate(repo: Path, count: int, slots: int) -> float:
    out = subprocess.run([sys.executable, "-c", WORKER_ONLY, str(count), str(slots)], cwd=repo,
                         env=environ_without_settings(), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the worker measure failed in {repo}:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout to measure first, for the ratio")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warm-s", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--api-workers", type=int, default=1)
    parser.add_argument("--requests", type=int, default=3000, help="the worker measure's one-token requests")
    parser.add_argument("--only", default="stack,worker")
    parser.add_argument("--client", choices=("httpx", "aiohttp"), default="aiohttp",
                        help="the stack measure's HTTP client (it runs on the same cores)")
    parser.add_argument("--access-log", choices=("on", "off"), default="on",
                        help="the API's access log (STRATA_ACCESS_LOG: a baseline without the option keeps its own)")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    runs = ([("baseline", args.baseline)] if args.baseline else []) + [("this checkout", here)]
    measures = args.only.split(",")
    for measure_name in measures:
        rates = {}
        for name, repo in runs:
            if measure_name == "stack":
                with served("--parallel", str(args.parallel), "--fake-decode-ms-per-step", "1",
                            "--api-workers", str(args.api_workers), cwd=repo,
                            settings={"STRATA_ACCESS_LOG": str(args.access_log == "on")}) as stack:
                    before = cpu_seconds(stack.serve.pid)
                    rate, failures, answered = asyncio.run(measure(stack.base, args.clients, args.seconds,
                                                                   args.warm_s, args.client))
                    spent = cpu_per_request(before, cpu_seconds(stack.serve.pid), answered)
                print(f"stack, {name} ({repo}): {rate:.0f} one-token requests/s end to end, {failures} failed; "
                      f"{args.clients} {args.client} clients, {args.parallel} slots, api workers {args.api_workers}, "
                      f"access log {args.access_log}; {load()}\n"
                      f"  {spent}", flush=True)
            else:
                rate = worker_rate(repo, args.requests, args.parallel)
                print(f"worker, {name} ({repo}): {rate:.0f} one-token requests/s, the worker loop alone; "
                      f"{args.requests} requests, {args.parallel} slots; {load()}", flush=True)
            rates[name] = rate
        if args.baseline:
            print(f"{measure_name} ratio: {rates['this checkout'] / rates['baseline']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
