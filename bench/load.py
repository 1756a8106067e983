"""Load test of the front end and the queues, with fake-engine workers (no model weights).

Four measures, each against a fresh `strata serve --engine fake` (embedded Redis with its default
append-only persistence, like `make serve`) or its queue layer:

- submit:  HTTP submissions per second (`"background": true`, answered 202 once enqueued) from
           --clients concurrent connections for --seconds, and per API core: submissions divided
           by the CPU seconds the API processes used (read from /proc), which is what one core
           sustains even on a machine shared with the client and the workers.
- queue:   enqueue -> claim latency with 0, 10 000 and 100 000 requests waiting. The real worker
           loop (workers/loop.py over the fake engine, costs 0) runs in a process of its own with
           its only slot reserved for priority >= 50 (--reserve 1:50), so the backlog at priority
           -50 stays waiting; each probe is enqueued at priority 60 through the API's own Intake
           and the time from the enqueue call to the worker's claim returning is read with one
           monotonic clock (both processes, one machine). The claim script alone is timed too.
           Also: Redis memory per waiting request (INFO used_memory delta / count).
- streams: --streams SSE streams held open at once, all waiting (the only slot is reserved); then
           the API's memory, its CPU use while they idle, one probe request's time through them,
           and how long it takes, once the clients leave, until every one is cancelled.

    .venv/bin/python -m bench.load [--only submit,queue,streams] [--api-workers 1] [--clients 64]
        [--seconds 20] [--depths 0,10000,100000] [--probes 300] [--streams 2000]

Every result line carries the machine's load average (`uptime`): the cores are shared.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence
from pathlib import Path

import httpx
import redis
import redis.asyncio as aioredis

from engine.fake_live import live_fake_engine
from engine.files import default_model_path, served_model_name
from queues.claims import Claimed, Claims, Waiting
from queues.intake import Intake
from queues.keys import Keys
from queues.records import QueuedRequest
from queues.server import EmbeddedRedis, free_port, terminate
from queues.settings import environ_without_settings
from workers.loop import Worker
from workers.scheduler import Policy, Reserve

MODEL = served_model_name(default_model_path())
MESSAGES = [{"role": "user", "content": "Summarize: disk /var is 97% full on db-3."}]
BACKLOG_PRIORITY = -50
PROBE_PRIORITY = 60
RESERVED_FROM = 50
WARM_PROBES = 30  # not counted: the first claims of a depth run colder (caches, a fresh process)


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- a served stack -------------------------------------------------------------------------


@dataclass
class Stack:
    base: str
    redis: redis.Redis
    serve: subprocess.Popen

    def api_pids(self) -> list[int]:
        """The `strata api` children of serve."""
        out = subprocess.run(["pgrep", "-P", str(self.serve.pid), "-f", "strata api"], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


def cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


@contextmanager
def served(*flags: str, cwd: Path | None = None, settings: dict[str, str] | None = None) -> Iterator[Stack]:
    """`strata serve --engine fake` with these flags (from checkout `cwd`: `python -m` puts it
    first on the path; None: this one) and these STRATA_ variables (an older checkout that lacks
    one ignores it, where it would refuse the flag)."""
    data = Path(tempfile.mkdtemp(prefix="strata-load-"))
    port = free_port()
    env = {**environ_without_settings(), **(settings or {})}
    serve = subprocess.Popen(
        [sys.executable, "-m", "strata", "serve", "--engine", "fake", "--port", str(port), "--data-dir", str(data),
         "--max-waiting", "0", "--queue-hard-limit", "0", *flags],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=(data / "serve.log").open("w"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{base}/v1/models", timeout=2).json()["data"]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline or serve.poll() is not None:
                raise RuntimeError(f"strata serve --engine fake did not come up; see {data / 'serve.log'}")
            time.sleep(0.2)
        client = redis.Redis.from_url((data / "redis.url").read_text(), decode_responses=True)
        yield Stack(base, client, serve)
        client.close()
    finally:
        terminate(serve, 60)
        print(f"(serve's log: {data / 'serve.log'})")


# ---- submissions per second ---------------------------------------------------------------


async def submit_for(base: str, clients: int, seconds: float) -> tuple[int, int]:
    """(accepted, refused or failed) background submissions from `clients` connections."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "background": True}
    accepted = failed = 0
    stop_at = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as http:
        async def one_client() -> None:
            nonlocal accepted, failed
            while time.monotonic() < stop_at:
                try:
                    r = await http.post("/v1/chat/completions", json=body)
                except httpx.TransportError as error:
                    print(f"submit: {type(error).__name__}: {error}")
                    failed += 1
                    continue
                if r.status_code == 202:
                    accepted += 1
                else:
                    failed += 1
        await asyncio.gather(*(one_client() for _ in range(clients)))
    return accepted, failed


def bench_submit(api_workers: int, clients: int, seconds: float) -> None:
    with served("--api-workers", str(api_workers), "--parallel", "64", "--fake-decode-ms-per-step", "1") as stack:
        pids = stack.api_pids()
        asyncio.run(submit_for(stack.base, clients, 2))  # warm: connections, caches
        cpu0, t0 = cpu_seconds(pids), time.monotonic()
        accepted, failed = asyncio.run(submit_for(stack.base, clients, seconds))
        cpu, wall = cpu_seconds(pids) - cpu0, time.monotonic() - t0
    print(f"submit: api_workers={api_workers} clients={clients}: {accepted / wall:.0f} submissions/s wall "
          f"({accepted} in {wall:.1f} s, {failed} not accepted); API CPU {cpu:.1f} s -> "
          f"{accepted / cpu:.0f} submissions per API CPU-second; {load()}")


# ---- enqueue -> claim latency ----------------------------------------------------------------


class TimedClaims(Claims):
    """The worker's own Claims, noting when each claim started and returned."""

    def __init__(self, *args, sink, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.sink = sink

    def claim_many(self, waiting: Sequence[Waiting], now_ms: int) -> list[Claimed | None]:
        began = time.monotonic_ns()
        claimed = super().claim_many(waiting, now_ms)
        for each in claimed:
            if each:
                self.sink.put((each.request.id, began, time.monotonic_ns()))
        return claimed


def run_worker(redis_url: str, sink, stop) -> None:  # noqa: ANN001 - multiprocessing queue and event
    client = redis.Redis.from_url(redis_url)
    engine = live_fake_engine(1, 2048, 0.0, 0.0)
    claims = TimedClaims(client, MODEL, f"bench-{os.getpid()}", sink=sink)
    worker = Worker(engine, claims, engine.tokenizer, prefill_chunk=256,
                    policy=Policy(reserve=(Reserve(1, RESERVED_FROM),)))
    threading.Thread(target=lambda: (stop.wait(), setattr(worker, "stopping", True)), daemon=True).start()
    worker.run()


async def fill(intake: Intake, count: int, prompt: list[int], fields: dict[str, str], start: int) -> None:
    """`count` waiting requests through the API's enqueue path, many at a time."""
    for first in range(start, start + count, 64):
        await asyncio.gather(*(
            intake.enqueue(QueuedRequest(f"backlog-{i}", BACKLOG_PRIORITY, prompt, 4), fields)
            for i in range(first, min(first + 64, start + count))))


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def bench_queue(depths: list[int], probes: int) -> None:
    from engine.tokenizer import Tokenizer

    prompt = Tokenizer.from_model_path(default_model_path()).encode_chat(MESSAGES)
    fields = {"endpoint": "/v1/chat/completions", "created": str(int(time.time())), "include_usage": "0",
              "detach": "0"}  # what the API writes beside the queue's own fields
    server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="strata-load-redis-"))).start()
    sync = redis.Redis.from_url(server.url, decode_responses=True)
    context = multiprocessing.get_context("spawn")
    sink, stop = context.Queue(), context.Event()
    worker = context.Process(target=run_worker, args=(server.url, sink, stop), daemon=True)
    worker.start()

    async def measure() -> None:
        client = aioredis.Redis.from_url(server.url)
        intake = Intake(client, MODEL)
        waiting = 0
        for depth in depths:
            before = used_memory(sync)
            await fill(intake, depth - waiting, prompt, fields, waiting)
            if depth > waiting:
                per = (used_memory(sync) - before) / (depth - waiting)
                print(f"memory: {per:.0f} bytes per waiting request ({len(prompt)}-token prompt), "
                      f"{depth - waiting} added; {load()}")
            waiting = depth
            assert sync.zcard(Keys(MODEL).waiting) == depth
            sent: dict[str, int] = {}
            total, claim_only = [], []
            for n in range(-WARM_PROBES, probes):
                rid = f"probe-{depth}-{n}"
                sent[rid] = time.monotonic_ns()
                await intake.enqueue(QueuedRequest(rid, PROBE_PRIORITY, prompt, 1), fields)
                got, began, claimed = await asyncio.to_thread(sink.get, True, 30)
                assert got == rid, (got, rid)
                if n >= 0:
                    total.append((claimed - sent[rid]) / 1e6)
                    claim_only.append((claimed - began) / 1e6)
                # the slot frees when the fake answer ends: wait for that before the next probe
                while sync.hget(Keys(MODEL).req(rid), "status") == "running":
                    await asyncio.sleep(0.0005)
            print(f"queue: {depth} waiting: enqueue->claim p50 {pct(total, .5):.2f} ms p99 {pct(total, .99):.2f} ms "
                  f"(claim script alone p50 {pct(claim_only, .5):.2f} p99 {pct(claim_only, .99):.2f} ms), "
                  f"{probes} probes; {load()}")
        await client.aclose()

    try:
        asyncio.run(measure())
    finally:
        stop.set()
        worker.join(10)
        sync.close()
        server.stop()


# ---- idle streams ------------------------------------------------------------------------------


async def hold_streams(stack: Stack, count: int) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=count + 10)
    keys = Keys(MODEL)
    async with httpx.AsyncClient(base_url=stack.base, limits=limits, timeout=120) as http:
        opened = asyncio.Event()
        started = 0
        release = asyncio.Event()

        async def one() -> None:
            nonlocal started
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, r.status_code
                lines = r.aiter_lines()  # kept: leaving the iterator would close the stream
                await anext(lines)  # the opening chunk: it waits now
                started += 1
                if started == count:
                    opened.set()
                await release.wait()

        t0 = time.monotonic()
        tasks = [asyncio.create_task(one()) for _ in range(count)]
        await asyncio.wait_for(opened.wait(), 300)
        open_s = time.monotonic() - t0
        pids = stack.api_pids()
        cpu0 = cpu_seconds(pids)
        await asyncio.sleep(10)
        idle_cpu = (cpu_seconds(pids) - cpu0) / 10
        t1 = time.monotonic()
        probe = await http.post("/v1/chat/completions", json={**body, "stream": False, "priority": PROBE_PRIORITY})
        probe_ms = (time.monotonic() - t1) * 1000
        clients = stack.redis.info("clients")["connected_clients"]
        print(f"streams: {count} open (all opened in {open_s:.1f} s), waiting {stack.redis.zcard(keys.waiting)}; "
              f"API RSS {rss_mib(pids):.0f} MiB, API CPU while they idle {idle_cpu * 100:.0f}% of a core, "
              f"Redis clients {clients}; a priority-{PROBE_PRIORITY} request through them: {probe_ms:.0f} ms "
              f"(status {probe.status_code}); {load()}")
        t2 = time.monotonic()
        release.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    while stack.redis.zcard(keys.waiting) and time.monotonic() - t2 < 120:
        await asyncio.sleep(0.05)
    print(f"streams: clients gone -> all {count} cancelled in {time.monotonic() - t2:.1f} s "
          f"(waiting now {stack.redis.zcard(keys.waiting)}); {load()}")


def bench_streams(api_workers: int, count: int) -> None:
    with served("--api-workers", str(api_workers), "--parallel", "1", "--reserve", f"1:{RESERVED_FROM}") as stack:
        asyncio.run(hold_streams(stack, count))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="submit,queue,streams")
    parser.add_argument("--api-workers", type=int, default=1)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--depths", default="0,10000,100000")
    parser.add_argument("--probes", type=int, default=300)
    parser.add_argument("--streams", type=int, default=2000)
    args = parser.parse_args()
    parts = args.only.split(",")
    print(f"start: {load()}; {os.cpu_count()} cores")
    if "queue" in parts:
        bench_queue([int(d) for d in args.depths.split(",")], args.probes)
    if "submit" in parts:
        bench_submit(args.api_workers, args.clients, args.seconds)
    if "streams" in parts:
        bench_streams(args.api_workers, args.streams)


if __name__ == "__main__":
    main()
