"""Time to first token of requests that share a prompt prefix through the worker's KV pool (issue
30's goal): the real worker loop (workers/loop.py) over the default SmolLM2 engine, a real Redis
(the embedded one `strata serve` starts), requests enqueued through the API's own path (Intake).
Two scenarios a round, each on a fresh worker (its pool holds nothing) and a prefix of its own:

- cached: one request reads a system prompt of PREFIX tokens and its question; then two more
  with that prefix and other questions arrive together (enqueued before the worker's next step).
  Goal: each of the two's time to first token <= 0.3x the first's.
- new: two requests with one new prefix arrive together. The second reads only its question once
  it takes the lines (workers/blocks.py `catch_up`), so its time to first token is the first's
  plus that; before catch-up it read the prefix again (about 2x the first's).

Time to first token is the request hash's first_token_ms - enqueued_ms (both the wall clock).

    .venv/bin/python -m bench.prefix_reuse [--prefix 1500] [--rounds 3] [--chunk 256]

With `--workers 2`: the cached scenario only, on two workers (two engines, each worker's loop
running as in `strata worker`, in a thread of its own, waking on the queue's wake lists), once
with prefix affinity (`--affinity-wait-s`, default the worker's 0.5 s) and once without (0), in
turns: which worker served each of the two arriving together, and their time to first token.
Without affinity the one the other worker claims reads the whole prefix again (~1.0x).

    .venv/bin/python -m bench.prefix_reuse --workers 2 [--prefix 1500] [--rounds 3]

Prints each round and the medians with their ratios to the first request's, and the load
average: compare ratios, not seconds (the cores are shared)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import redis

from bench.worker_overhead import enqueue
from engine import load_engine
from queues.claims import Claims
from queues.keys import Keys
from queues.records import QueuedRequest
from queues.server import EmbeddedRedis
from workers.loop import Worker
from workers.scheduler import Policy

MODEL = "bench"


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def serve(client: redis.Redis, url: str, worker: Worker, requests: list[QueuedRequest]) -> list[float]:
    """Enqueue the requests together, run the worker until idle; each one's seconds to first token."""
    enqueue(url, MODEL, requests)
    while worker.step():
        pass
    keys = Keys(MODEL)
    out = []
    for request in requests:
        h = client.hgetall(keys.req(request.id))
        if h.get("status") != "finished":
            raise RuntimeError(f"{request.id}: {h.get('status')} ({h})")
        out.append((int(h["first_token_ms"]) - int(h["enqueued_ms"])) / 1000)
    return out


def system(length: int, salt: int) -> list[int]:
    """A system prompt of its own per salt: no other round's blocks match it."""
    return [(17 * i + 101 * salt) % 40000 + 100 for i in range(length)]


def ask(rid: str, prompt: list[int]) -> QueuedRequest:
    return QueuedRequest(id=rid, priority=0, prompt=prompt, max_tokens=1, temperature=0.0)


def serve_running(client: redis.Redis, url: str, requests: list[QueuedRequest],
                  timeout_s: float = 600) -> list[tuple[float, str, int]]:
    """Enqueue the requests together and wait until they finished (the workers run in threads);
    each one's (seconds to first token, the worker that served it, its cached prompt tokens)."""
    enqueue(url, MODEL, requests)
    keys = Keys(MODEL)
    end = time.monotonic() + timeout_s
    while True:
        hashes = [client.hgetall(keys.req(r.id)) for r in requests]
        if all(h.get("status") == "finished" for h in hashes):
            break
        bad = [h for h in hashes if h.get("status") in ("failed", "cancelled", "expired")]
        if bad or time.monotonic() > end:
            raise RuntimeError(f"not served: {bad or hashes}")
        time.sleep(0.05)
    return [((int(h["first_token_ms"]) - int(h["enqueued_ms"])) / 1000, h["worker"], int(h.get("cached_tokens") or 0))
            for h in hashes]


def two_workers(args: argparse.Namespace) -> None:
    """The cached scenario on two workers, with and without prefix affinity, in turns."""
    engines = [load_engine(None, num_slots=3, ctx=4096, kv_tokens=3 * 4096, compile=False, prompt_lookup=False)
               for _ in range(2)]
    print(f"loaded two engines; {load()}", flush=True)
    rows: dict[float, list[tuple[float, float, float]]] = {args.affinity_wait_s: [], 0.0: []}
    with tempfile.TemporaryDirectory(prefix="strata-prefix-reuse-") as scratch:
        server = EmbeddedRedis(data_dir=Path(scratch), appendonly=False).start()
        client = redis.Redis.from_url(server.url, decode_responses=True)
        try:
            for r in range(args.rounds):
                for wait_s in rows:
                    tag = f"r{r}-a{wait_s:g}"
                    workers = [Worker(engine, Claims(client, MODEL, f"{tag}-w{i}"), engine.tokenizer,
                                      prefill_chunk=args.chunk, policy=Policy(affinity_wait_s=wait_s))
                               for i, engine in enumerate(engines)]
                    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
                    for t in threads:
                        t.start()
                    try:
                        prefix = system(args.prefix, 100 + 2 * r + (wait_s > 0))
                        ((first, holder, _),) = serve_running(client, server.url,
                                                              [ask(f"{tag}-first", prefix + [11, 12, 13, 14, 15])])
                        time.sleep(0.2)  # the holder idle again, its prefix advertised
                        pair = serve_running(client, server.url, [ask(f"{tag}-second", prefix + [21, 22, 23]),
                                                                  ask(f"{tag}-third", prefix + [31, 32, 33, 34])])
                    finally:
                        for w in workers:
                            w.stopping = True
                        for t in threads:
                            t.join()
                    rows[wait_s].append((first, pair[0][0], pair[1][0]))
                    where = ", ".join(f"{'holder' if w == holder else 'other'} ({cached} cached) {ttft:.3f} s "
                                      f"({ttft / first:.3f}x)" for ttft, w, cached in pair)
                    print(f"round {r + 1}, affinity wait {wait_s:g} s: first {first:.3f} s; then together: {where}; "
                          f"{load()}", flush=True)
        finally:
            client.close()
            server.stop()
    print(f"prefix {args.prefix} tokens, chunk {args.chunk}, two workers, median of {args.rounds} rounds:")
    for wait_s, got in rows.items():
        first, second, third = (statistics.median(c[i] for c in got) for i in range(3))
        print(f"  affinity wait {wait_s:g} s: first {first:.3f} s; the two arriving together {second:.3f} s "
              f"({second / first:.3f}x) and {third:.3f} s ({third / first:.3f}x)")
    print(f"  {load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256, help="the worker's --prefill-chunk")
    parser.add_argument("--workers", type=int, choices=(1, 2), default=1)
    parser.add_argument("--affinity-wait-s", type=float, default=Policy().affinity_wait_s,
                        help="with --workers 2: the affinity wait measured beside 0 (off)")
    args = parser.parse_args()
    if args.workers == 2:
        two_workers(args)
        return
    engine = load_engine(None, num_slots=3, ctx=4096, kv_tokens=3 * 4096, compile=False, prompt_lookup=False)
    print(f"loaded; {load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="strata-prefix-reuse-") as scratch:
        server = EmbeddedRedis(data_dir=Path(scratch), appendonly=False).start()
        client = redis.Redis.from_url(server.url, decode_responses=True)
        cached: list[tuple[float, float, float]] = []
        new: list[tuple[float, float]] = []
        try:
            for r in range(args.rounds):
                w = Worker(engine, Claims(client, MODEL, f"cached-{r}"), engine.tokenizer, prefill_chunk=args.chunk)
                prefix = system(args.prefix, 2 * r)
                (first,) = serve(client, server.url, w, [ask(f"c{r}-first", prefix + [11, 12, 13, 14, 15])])
                second, third = serve(client, server.url, w, [ask(f"c{r}-second", prefix + [21, 22, 23]),
                                                                      ask(f"c{r}-third", prefix + [31, 32, 33, 34])])
                w.stop()
                cached.append((first, second, third))
                w = Worker(engine, Claims(client, MODEL, f"new-{r}"), engine.tokenizer, prefill_chunk=args.chunk)
                prefix = system(args.prefix, 2 * r + 1)
                pair = serve(client, server.url, w, [ask(f"n{r}-a", prefix + [41, 42, 43]),
                                                            ask(f"n{r}-b", prefix + [51, 52])])
                w.stop()
                new.append((pair[0], pair[1]))
                print(f"round {r + 1}: cached {first:.3f} s, then together {second:.3f} / {third:.3f} s "
                      f"({second / first:.3f}x / {third / first:.3f}x); new prefix together {pair[0]:.3f} / "
                      f"{pair[1]:.3f} s ({pair[1] / pair[0]:.3f}x); {load()}", flush=True)
        finally:
            client.close()
            server.stop()
    first, second, third = (statistics.median(c[i] for c in cached) for i in range(3))
    a, b = (statistics.median(n[i] for n in new) for i in range(2))
    print(f"prefix {args.prefix} tokens, chunk {args.chunk}, median of {args.rounds} rounds:\n"
          f"  cached: first {first:.3f} s; the two arriving together {second:.3f} s ({second / first:.3f}x) and "
          f"{third:.3f} s ({third / first:.3f}x) (goal: each <= 0.3x)\n"
          f"  new prefix, two together: {a:.3f} s and {b:.3f} s ({b / a:.3f}x the first's; reading it again: ~2x)\n"
          f"  {load()}")


if __name__ == "__main__":
    main()
