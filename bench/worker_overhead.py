"""What the worker loop costs per step beside the engine: the real default engine and a real
Redis (the embedded one `strata serve` starts, same settings), the real `workers.loop.Worker`,
requests enqueued through the API's own path (Intake), no HTTP.

    .venv/bin/python -m bench.worker_overhead [--clients 1 4 8] [--tokens 128] [--profile]

For each client count: that many streaming requests (`ignore_eos`, `--tokens` each) run to the
end; every call into the engine and into `queues.claims.Claims` (each one a Redis round trip or a
Lua script) is timed. Prints per decode step: wall time, engine time, Redis time, the rest
(Python in the loop: scheduling, text decoding, bookkeeping), and of the rest the garbage
collector's time (per step, over every round) and its longest pause. `--heap frozen` (the
default) collects and freezes what loading built, as `strata worker` does (workers/main.py,
`gc.freeze`); `unfrozen` leaves it to the collector, as before Dec 7 (compare two runs).
`--profile` adds cProfile's top functions by own time; `--parts` times the pieces of the
engine's decode call (the compiled step's own run, the step's inputs, the embedding, sampling)
without cProfile's cost, in ms a call over every round."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import gc
import inspect
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def timed(table: dict[str, list[float]], name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        started = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            table[name].append(time.perf_counter() - started)
    return wrapper


def time_parts(table: dict[str, list[float]]) -> None:
    """Every call of the decode call's pieces timed into `table` (class attributes wrapped, so the
    engine loaded after this is timed)."""
    import engine.aot
    import engine.compiled
    import engine.model
    import engine.runner

    for owner, name, label in ((engine.runner.TorchEngine, "decode", "engine.decode"),
                               (engine.compiled.CompiledDecode, "__call__", "compiled step (all of it)"),
                               (engine.aot.PackagedStep, "__call__", "compiled step's own run"),
                               (engine.model.Transformer, "step_inputs", "step inputs"),
                               (engine.model.Transformer, "embed_tokens", "embedding"),
                               (engine.runner, "sample_tokens", "sampling")):
        setattr(owner, name, timed(table, label, getattr(owner, name)))


def enqueue(url: str, model: str, requests: list) -> None:
    import redis.asyncio as aioredis

    from queues.intake import Intake

    async def go() -> None:
        client = aioredis.Redis.from_url(url)
        try:
            intake = Intake(client, model)
            for request in requests:
                await intake.enqueue(request)
        finally:
            await client.aclose()

    asyncio.run(go())


def run(engine, url: str, clients: int, tokens: int, round_: int, profile: cProfile.Profile | None,
        temperature: float = 0.0) -> dict:
    import redis

    from queues.claims import Claims
    from queues.records import QueuedRequest
    from workers.loop import Worker

    model = "bench"
    client = redis.Redis.from_url(url, decode_responses=True)
    claims = Claims(client, model, f"bench-{round_}")
    calls: dict[str, list[float]] = defaultdict(list)
    for name, fn in inspect.getmembers(claims, inspect.ismethod):
        if not name.startswith("_"):
            setattr(claims, name, timed(calls, f"redis.{name}", fn))
    worker = Worker(engine, claims, engine.tokenizer, prefill_chunk=256)
    engine_calls: dict[str, list[float]] = defaultdict(list)
    read, decode = engine.read, engine.decode
    engine.read = timed(engine_calls, "engine.read", read)
    engine.decode = timed(engine_calls, "engine.decode", decode)
    try:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me a long story about a lighthouse."}])
        enqueue(url, model, [QueuedRequest(id=f"r{round_}-{i}", priority=0, prompt=prompt + [i + 10], max_tokens=tokens,
                                           temperature=temperature, ignore_eos=True) for i in range(clients)])
        steps = 0
        pauses: list[float] = []
        began: list[float] = []

        def collected(phase: str, _info: dict) -> None:
            if phase == "start":
                began.append(time.perf_counter())
            else:
                pauses.append(time.perf_counter() - began.pop())

        gc.callbacks.append(collected)
        try:
            started = time.perf_counter()
            if profile:
                profile.enable()
            while worker.step():
                steps += 1
            if profile:
                profile.disable()
            wall = time.perf_counter() - started
        finally:  # a failed run's callback would time the next run's collections
            gc.callbacks.remove(collected)
    finally:
        engine.read, engine.decode = read, decode
        client.close()
    decodes = len(engine_calls["engine.decode"])
    engine_s = sum(sum(v) for v in engine_calls.values())
    redis_s = sum(sum(v) for v in calls.values())
    per = 1000 / max(decodes, 1)
    return {"clients": clients, "steps": steps, "decode_steps": decodes, "tok_s": clients * tokens / wall,
            "step_ms": wall * per, "engine_ms": engine_s * per, "redis_ms": redis_s * per,
            "rest_ms": (wall - engine_s - redis_s) * per, "gc_ms": sum(pauses) * per,
            "gc_max_ms": 1000 * max(pauses, default=0.0), "heap": "frozen" if gc.get_freeze_count() else "unfrozen",
            "redis_calls": {k.removeprefix("redis."): (len(v), round(1000 * sum(v) / len(v), 3)) for k, v in calls.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs per client count (the faster is shown)")
    parser.add_argument("--appendfsync", default="everysec", choices=["always", "everysec"],
                        help="the embedded Redis's (strata serve's --redis-fsync)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--parts", action="store_true", help="time the pieces of the engine's decode call")
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--serve-pool", action="store_true",
                        help="the engine as `strata serve` loads it: requests up to the model's context, a pool of "
                             "--parallel x 2048 tokens (default: ctx 2048 a slot)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-prompt-lookup", dest="prompt_lookup", action="store_false",
                        help="one token a step (strata serve --no-prompt-lookup)")
    parser.add_argument("--heap", default="frozen", choices=["frozen", "unfrozen"],
                        help="what loading built frozen out of the collector's reach (as strata worker does), or not")
    args = parser.parse_args()

    from engine.load import load_engine
    from queues.server import EmbeddedRedis

    parts: dict[str, list[float]] = defaultdict(list)
    if args.parts:
        time_parts(parts)
    server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="strata-overhead-")), appendfsync=args.appendfsync).start()
    profile = cProfile.Profile() if args.profile else None
    try:
        sizes = {"ctx": None, "kv_tokens": args.parallel * 2048} if args.serve_pool else {"ctx": 2048}
        engine = load_engine(args.model, num_slots=args.parallel, prompt_lookup=args.prompt_lookup, **sizes)
        if args.heap == "frozen":  # as workers/main.py leaves it after loading
            gc.collect()
            gc.freeze()
        results = []
        for clients in args.clients:
            runs = [run(engine, server.url, clients, args.tokens, 100 * clients + r, profile, args.temperature)
                    for r in range(args.rounds)]
            best = max(runs, key=lambda r: r["tok_s"])
            # the collector's time over every round: its long pauses are rare, not in the best round
            best |= {"gc_ms": sum(r["gc_ms"] * r["decode_steps"] for r in runs) / sum(r["decode_steps"] for r in runs),
                     "gc_max_ms": max(r["gc_max_ms"] for r in runs)}
            results.append(best)
    finally:
        server.stop()

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Worker loop per decode step (real engine, embedded Redis appendfsync {args.appendfsync}, "
                        f"{args.tokens} tokens a request)")
    for column in ("clients", "heap", "tok/s", "step ms", "engine ms", "Redis ms", "rest ms", "of it GC ms",
                   "longest GC ms", "Redis calls (count, ms each)"):
        table.add_column(column, justify="right" if column != "Redis calls (count, ms each)" else "left")
    for r in results:
        table.add_row(str(r["clients"]), r["heap"], f"{r['tok_s']:.1f}", f"{r['step_ms']:.2f}", f"{r['engine_ms']:.2f}",
                      f"{r['redis_ms']:.2f}", f"{r['rest_ms']:.2f}", f"{r['gc_ms']:.2f}", f"{r['gc_max_ms']:.1f}",
                      ", ".join(f"{k} {n}×{ms}" for k, (n, ms) in sorted(r["redis_calls"].items())))
    Console(width=200).print(table)
    for name, times in parts.items():
        print(f"{name:28s} {len(times):6d} calls {1000 * sum(times) / len(times):8.3f} ms each")
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
