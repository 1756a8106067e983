"""The acceptance scenarios of docs/design.md on the real engine, each run twice: with priority and
without (every request at 0). Times come from the request hashes the worker writes.

    .venv/bin/python -m bench.priority_scenarios [--dtype bfloat16] [--scale 1.0] [--only reserve]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from engine import load_engine
from engine.files import resolve_model_path, served_model_name
from queues.claims import Claims
from queues.intake import Intake
from queues.keys import Keys
from queues.records import QueuedRequest
from queues.server import EmbeddedRedis
from workers.loop import Worker
from workers.scheduler import Policy, Reserve


@dataclass
class Run:
    url: str
    model: str
    engine: object
    chunk: int
    policy: Policy = Policy()

    def __enter__(self) -> "Run":
        self.client = redis.Redis.from_url(self.url, decode_responses=True)
        self.client.flushdb()
        self.worker = Worker(self.engine, Claims(self.client, self.model, "bench"), self.engine.tokenizer,
                             prefill_chunk=self.chunk, policy=self.policy, idle_wait_s=0.01)
        self.worker.announce(int(time.time() * 1000))  # aging is in Redis before the first enqueue
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.stopping = True
        self.thread.join(30)
        self.client.close()

    def submit(self, rid: str, priority: int, prompt: list[int], max_tokens: int) -> float:
        async def go() -> None:
            client = aioredis.Redis.from_url(self.url)
            await Intake(client, self.model).enqueue(QueuedRequest(
                id=rid, priority=priority, prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0))
            await client.aclose()

        asyncio.run(go())
        return time.time() * 1000

    def record(self, rid: str) -> dict[str, str]:
        return self.client.hgetall(Keys(self.model).req(rid))

    def wait(self, rids: list[str], timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.record(r).get("status") != "finished" for r in rids):
            if time.monotonic() > deadline:
                raise TimeoutError(rids)
            time.sleep(0.05)


def alert_during_battery(run: Run, tokens: list[int], with_priority: bool, scale: float) -> dict[str, float]:
    slots = run.engine.num_slots
    answer = int(160 * scale)
    battery = [f"battery-{i}" for i in range(3 * slots)]  # slots decoding + twice as many waiting
    low = -5 if with_priority else 0
    for i, rid in enumerate(battery):  # prompts that share no prefix: no slot's cache helps anyone
        run.submit(rid, low, tokens[100 + 50 * i:140 + 50 * i], answer)
    while sum(run.record(r).get("status") == "running" for r in battery) < slots:
        time.sleep(0.01)
    time.sleep(1.0)  # everyone is decoding
    sent = run.submit("alert", 10 if with_priority else 0, tokens[:30], 8)  # its own words too
    run.wait(["alert"] + battery)
    alert = run.record("alert")
    records = [run.record(r) for r in battery]
    freed = min(int(r["finished_ms"]) for r in records if int(r["finished_ms"]) >= sent)
    read_s = (int(alert["first_token_ms"]) - int(alert["claimed_ms"])) / 1000
    return {"ttft_s": (int(alert["first_token_ms"]) - sent) / 1000,
            "ideal_s": (freed - sent) / 1000 + read_s,
            "ahead": sum(int(r["claim_seq"]) < int(alert["claim_seq"]) for r in records) - slots}


def long_read_gives_way(run: Run, tokens: list[int], with_priority: bool, scale: float) -> dict[str, float]:
    length = int(1500 * scale)
    first, second = tokens[:length], tokens[1:length + 1]
    sent_first = run.submit("first", 0, first, 4)
    while not run.record("first").get("claimed_ms"):
        time.sleep(0.005)
    time.sleep(0.3)
    sent = run.submit("second", 9 if with_priority else 0, second, 4)
    run.wait(["first", "second"])
    a, b = run.record("first"), run.record("second")
    own_read_s = (int(b["first_token_ms"]) - int(b["claimed_ms"])) / 1000
    return {"ttft_s": (int(b["first_token_ms"]) - sent) / 1000,
            "first_ttft_s": (int(a["first_token_ms"]) - sent_first) / 1000,
            "yields": int(a.get("yields", 0)),
            # ideal: at most one chunk of the first read, then its own read
            "ideal_s": own_read_s * (1 + run.chunk / length)}


def reserved_slot(run: Run, tokens: list[int], scale: float) -> dict[str, float]:
    """The alert during a battery, all at their priorities; `run.policy` says whether a slot is
    reserved. Also the battery's throughput: its tokens over the time from its first claim to
    its last end."""
    slots = run.engine.num_slots
    answer = int(160 * scale)
    battery = [f"battery-{i}" for i in range(3 * slots)]
    for i, rid in enumerate(battery):
        run.submit(rid, -5, tokens[100 + 50 * i:140 + 50 * i], answer)
    serving = slots - sum(r.count for r in run.policy.reserve)
    while sum(run.record(r).get("status") == "running" for r in battery) < serving:
        time.sleep(0.01)
    time.sleep(1.0)
    sent = run.submit("alert", 10, tokens[:30], 8)
    run.wait(["alert"] + battery)
    alert = run.record("alert")
    records = [run.record(r) for r in battery]
    span_ms = max(int(r["finished_ms"]) for r in records) - min(int(r["claimed_ms"]) for r in records)
    return {"ttft_s": (int(alert["first_token_ms"]) - sent) / 1000,
            "claim_s": (int(alert["claimed_ms"]) - sent) / 1000,
            "battery_tok_s": sum(int(r["completion_tokens"]) for r in records) / (span_ms / 1000)}


def alert_alone(run: Run, tokens: list[int]) -> float:
    """The alert on an idle worker: its own read (and the loop's overhead), nothing else."""
    sent = run.submit("alert", 10, tokens[:30], 8)
    run.wait(["alert"])
    return (int(run.record("alert")["first_token_ms"]) - sent) / 1000


def reserve_rows(table: Table, server_url: str, model: str, engine: object, chunk: int, scale: float,
                 tokens: list[int], passes: int) -> None:
    reserve = Policy(reserve=(Reserve(1, 10),))
    for p in range(1, passes + 1):
        with Run(server_url, model, engine, chunk) as run:
            alone = alert_alone(run, tokens)
        with Run(server_url, model, engine, chunk, reserve) as run:
            kept = reserved_slot(run, tokens, scale)
        with Run(server_url, model, engine, chunk) as run:
            plain = reserved_slot(run, tokens, scale)
        table.add_row("--reserve 1:10: alert's TTFT during a battery", str(p), f"{kept['ttft_s']:.2f} s",
                      f"{plain['ttft_s']:.2f} s (priority, no reserve)", f"alone {alone:.2f} s "
                      f"(x{kept['ttft_s'] / alone:.2f})",
                      f"claimed after {kept['claim_s']:.2f} s; "
                      f"battery {kept['battery_tok_s']:.1f} tok/s vs {plain['battery_tok_s']:.1f} "
                      f"({100 * (kept['battery_tok_s'] / plain['battery_tok_s'] - 1):+.0f}%)")


def starvation(run: Run, tokens: list[int], flood_s: float, clients: int = 12) -> dict[str, float]:
    """`clients` closed-loop clients at priority 5 (each sends its next request when its last
    one ends) for flood_s; a priority-0 request arrives 2 s in. Its wait for a slot, with the
    worker's policy (aging or not)."""
    stop = time.monotonic() + flood_s
    sent_high: list[str] = []

    def client(c: int) -> None:
        n = 0
        while time.monotonic() < stop:
            rid = f"high-{c}-{n}"
            start = 100 + (37 * (c * 1000 + n)) % (len(tokens) - 200)
            run.submit(rid, 5, tokens[start:start + 40], 16)
            sent_high.append(rid)
            run.wait([rid])
            n += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    sent = run.submit("low", 0, tokens[:30], 8)
    for t in threads:
        t.join()
    run.wait(["low"])
    low = run.record("low")
    claimed = int(low["claimed_ms"])
    before = sum(int(run.record(r).get("claimed_ms") or 0) < claimed for r in sent_high)
    return {"wait_s": (claimed - sent) / 1000, "ttft_s": (int(low["first_token_ms"]) - sent) / 1000,
            "high_before": before, "high_total": len(sent_high)}


def aging_rows(table: Table, server_url: str, model: str, engine: object, chunk: int, tokens: list[int],
               aging_s: float, flood_s: float) -> None:
    with Run(server_url, model, engine, chunk, Policy(aging_s=aging_s)) as run:
        aged = starvation(run, tokens, flood_s)
    with Run(server_url, model, engine, chunk) as run:
        plain = starvation(run, tokens, flood_s)
    bound = (5 - 0) * aging_s
    table.add_row(f"aging: priority 0 under 12 clients at 5 for {flood_s:g} s: its wait for a slot", "1",
                  f"{aged['wait_s']:.2f} s (--aging-s {aging_s:g})", f"{plain['wait_s']:.2f} s (no aging)",
                  f"(q-p)*S = {bound:g} s + service",
                  f"high requests served before it: {aged['high_before']}/{aged['high_total']} vs "
                  f"{plain['high_before']}/{plain['high_total']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--scale", type=float, default=1.0, help="answer and prompt lengths")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--only", choices=["alert", "long", "reserve", "aging"], default=None, help="one scenario")
    parser.add_argument("--aging-s", type=float, default=2.0)
    parser.add_argument("--flood-s", type=float, default=60.0, help="how long the aging scenario's flood lasts")
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    wanted = {args.only} if args.only else {"alert", "long", "reserve", "aging"}
    path = resolve_model_path(None)
    model = served_model_name(path)
    engine = load_engine(path, num_slots=args.parallel, ctx=2048, dtype=args.dtype)
    text = Path(__file__).read_text() * 4
    tokens = engine.tokenizer.encode(text)
    server = EmbeddedRedis(Path(tempfile.mkdtemp()), appendonly=False).start()
    console = Console(width=150)
    try:
        table = Table(title=f"Strata priority scenarios: SmolLM2, {engine.dtype}, {args.parallel} slots, chunk {args.chunk}")
        for col in ("scenario", "pass", "with priority", "without", "ideal (with)", "notes"):
            table.add_column(col)
        for p in range(1, args.passes + 1):
            if "alert" not in wanted:
                break
            res = {}
            for wp in (True, False):
                with Run(server.url, model, engine, args.chunk) as run:
                    res[wp] = alert_during_battery(run, tokens, wp, args.scale)
            table.add_row("alert during a battery: alert's TTFT", str(p), f"{res[True]['ttft_s']:.2f} s",
                          f"{res[False]['ttft_s']:.2f} s", f"{res[True]['ideal_s']:.2f} s",
                          f"battery requests served before it: {res[True]['ahead']} vs {res[False]['ahead']}")
        for p in range(1, args.passes + 1):
            if "long" not in wanted:
                break
            res = {}
            for wp in (True, False):
                with Run(server.url, model, engine, args.chunk) as run:
                    res[wp] = long_read_gives_way(run, tokens, wp, args.scale)
            table.add_row("long read gives way: second's TTFT", str(p), f"{res[True]['ttft_s']:.2f} s",
                          f"{res[False]['ttft_s']:.2f} s", f"{res[True]['ideal_s']:.2f} s",
                          f"parked read's TTFT {res[True]['first_ttft_s']:.2f} s vs {res[False]['first_ttft_s']:.2f} s; "
                          f"yields {res[True]['yields']}")
        if "reserve" in wanted:
            reserve_rows(table, server.url, model, engine, args.chunk, args.scale, tokens, args.passes)
        if "aging" in wanted:
            aging_rows(table, server.url, model, engine, args.chunk, tokens, args.aging_s, args.flood_s)
        console.print(table)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
