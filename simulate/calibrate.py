"""`strata calibrate`: time the real engine on this machine through its public interface
(Engine.begin / read / decode / truncate, exactly what a worker calls) and write a cost profile
(engine/cost_profile.py) for the simulator's fake engine.

Read: one slot holds `cached` tokens (truncate back to it between tries), a chunk of `tokens` is
read and timed. Decode: every slot holds `context` tokens and the first `rows` of them take one
step together. Each point is the median of a few tries, after a warm-up, and the grid written is a simple
cost model fitted through all points (`smoothed`), so one hiccup of a shared machine does not
move it.

The worker loop's own cost per step (Python, Redis round trips) is measured too: the real
workers/loop.py Worker over a fake engine that costs nothing, against a real Redis started as
`strata serve` starts it (appendfsync everysec), on the wall clock: ms per busy step."""

from __future__ import annotations

import datetime
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from engine.cost_profile import CostGrid, CostProfile
from engine.fake import FakeDecoder
from engine.protocol import Engine, SamplingParams
from workers.text import Decoder

log = logging.getLogger("strata.calibrate")


@dataclass(frozen=True)
class Plan:
    """Where to measure. Grids are clipped to the engine's ctx."""

    # Prompts dominate the time calibrating takes (on the CPU with int4 weights a few tens of
    # tokens/s, and every slot must be filled to the longest decode context), so few points:
    # costs are close to linear in between, and interpolation fills in.
    read_cached: tuple[int, ...] = (0, 256, 1024)
    read_tokens: tuple[int, ...] = (16, 64, 256)
    decode_contexts: tuple[int, ...] = (64, 256, 1024)
    decode_rows: tuple[int, ...] | None = None  # None: 1, 2, 3, ... up to the engine's slots (8 points at most)
    tries: int = 3
    smooth: bool = True  # write a fitted cost model's values rather than the raw medians (see smoothed)
    overhead_steps: int = 300  # worker-loop steps per try when timing the loop's own cost (0: skip it)

    @classmethod
    def quick(cls) -> "Plan":
        """Seconds, not a minute: for tests and a first look."""
        return cls(read_cached=(0, 64), read_tokens=(8, 32), decode_contexts=(16, 64), decode_rows=(1, 2), tries=1,
                   smooth=False, overhead_steps=60)


def rows_for(slots: int, wanted: Sequence[int] | None) -> list[int]:
    if wanted:
        return sorted({r for r in wanted if 1 <= r <= slots} | {1})
    if slots <= 8:
        return list(range(1, slots + 1))
    step = slots / 7
    return sorted({1, slots, *(round(1 + i * step) for i in range(1, 7))})


def measure(engine: Engine, tokens: Sequence[int], plan: Plan,
            clock: Callable[[], float] = time.perf_counter) -> tuple[CostGrid, CostGrid]:
    """The two grids, timed with `clock` (seconds). `tokens`: at least ctx prompt ids."""
    ctx = engine.ctx
    cached = sorted({c for c in plan.read_cached if c + min(plan.read_tokens) <= ctx})
    chunks = sorted({t for t in plan.read_tokens if t <= ctx})
    contexts = sorted({c for c in plan.decode_contexts if c + plan.tries + 1 < ctx})
    rows = rows_for(engine.num_slots, plan.decode_rows)
    greedy = SamplingParams(temperature=0.0)

    def timed(call: Callable[[], object]) -> float:
        start = clock()
        call()
        return (clock() - start) * 1000

    def hold(slot: int, length: int) -> None:
        """Make the slot hold exactly the first `length` tokens (truncate, or read what is missing)."""
        engine.truncate(slot, min(length, engine.position(slot)))
        for at in range(engine.position(slot), length, 256):
            engine.read(slot, tokens[at:min(length, at + 256)], sample=False)

    # warm-up: the first calls of a fresh engine pay for allocation and lazy set-up
    for slot in range(engine.num_slots):
        engine.begin(slot, greedy)
    hold(0, min(ctx - 2, 64))
    engine.decode([0], [tokens[0]])
    read_ms = []
    for c in cached:
        row = []
        for t in chunks:
            t = min(t, ctx - c)  # noqa: PLW2901 - a chunk clipped to what fits
            tries = []
            for _ in range(plan.tries):
                hold(0, c)
                tries.append(timed(lambda: engine.read(0, tokens[c:c + t], sample=True)))
            row.append(statistics.median(tries))
        read_ms.append(row)
        log.info("read with %d cached: %s ms", c, ", ".join(f"{t}: {ms:.1f}" for t, ms in zip(chunks, row)))
    by_context: dict[int, list[float]] = {}
    for c in contexts:
        for slot in range(engine.num_slots):
            hold(slot, c)
        for r in rows:
            tries = []
            for _ in range(plan.tries):
                tries.append(timed(lambda: engine.decode(list(range(r)), list(tokens[:r]))))
            for slot in range(r):
                hold(slot, c)
            by_context.setdefault(r, []).append(statistics.median(tries))
        log.info("decode at context %d: %s ms", c, ", ".join(f"{r} rows: {by_context[r][-1]:.1f}" for r in rows))
    read = CostGrid(rows=cached, columns=chunks, ms=read_ms)
    decode = CostGrid(rows=rows, columns=contexts, ms=[by_context[r] for r in rows])
    if plan.smooth:
        # read: a call's fixed cost, each token's, and attention over what is cached
        read = smoothed(read, lambda c, t: (1.0, t, t * c))
        # decode: a step's fixed cost, each row's, the longest context's, and each row's attention
        decode = smoothed(decode, lambda r, c: (1.0, r, c, r * c))
    return _rounded(read), _rounded(decode)


def smoothed(grid: CostGrid, terms: Callable[[int, int], tuple[float, ...]]) -> CostGrid:
    """The least-squares fit of a cost model linear in `terms` through every measured point,
    evaluated back on the grid: one slow try on a busy machine no longer bends the curve."""
    points = [(r, c) for r in grid.rows for c in grid.columns]
    design = np.array([terms(r, c) for r, c in points])
    if len(points) < design.shape[1]:
        return grid
    measured = np.array([v for row in grid.ms for v in row])
    weights = 1 / np.maximum(measured, 1e-3)  # relative errors: a 10 ms point counts as much as a 2 s one
    coef, *_ = np.linalg.lstsq(design * weights[:, None], measured * weights, rcond=None)
    fitted = design @ coef
    return CostGrid(grid.rows, grid.columns,
                    [[max(0.01, float(fitted[i * len(grid.columns) + j])) for j in range(len(grid.columns))]
                     for i in range(len(grid.rows))])


def _rounded(grid: CostGrid) -> CostGrid:
    return CostGrid(grid.rows, grid.columns, [[round(v, 3) for v in row] for row in grid.ms])


def step_overhead_ms(decoder: Decoder, slots: int, steps: int, tries: int = 3,
                     clock: Callable[[], float] = time.perf_counter) -> float:
    """ms per busy step of the real worker loop beside the engine: `slots` streaming requests
    (short prompts, answers long enough for about `steps` steps) served by workers/loop.py's
    Worker over a FakeEngine that costs nothing, through real Claims on a real Redis, on the wall
    clock. Median of `tries` runs, after a warm-up (script loading, first connections)."""
    import redis

    from engine.fake import FakeEngine
    from queues.claims import Claims
    from queues.records import QueuedRequest
    from queues.replay import Replay
    from queues.server import EmbeddedRedis
    from workers.loop import Worker, wall_ms

    model = "calibrate"
    with tempfile.TemporaryDirectory(prefix="strata-calibrate-") as folder:
        server = EmbeddedRedis(Path(folder), appendfsync="everysec").start()
        client = redis.Redis.from_url(server.url, decode_responses=True)
        try:
            engine = FakeEngine(num_slots=slots, ctx=max(64, steps + 64), read_ms_per_token=0.0,
                                decode_ms_per_step=0.0)
            worker = Worker(engine, Claims(client, model, "calibrate-0"), decoder, prefill_chunk=256)
            replay = Replay(client, model)

            def one_run(run: int, answer: int) -> float:
                for i in range(slots):
                    replay.enqueue(QueuedRequest(id=f"overhead-{run}-{i}", priority=0, prompt=[run + 2, i + 2] * 8,
                                                 max_tokens=answer, ignore_eos=True, temperature=0.0), wall_ms())
                busy, started = 0, clock()
                while worker.step():
                    busy += 1
                return (clock() - started) * 1000 / max(busy, 1)

            one_run(0, 8)
            return statistics.median(one_run(1 + n, steps) for n in range(tries))
        finally:
            client.close()
            server.stop()


def calibrate(engine: Engine, tokens: Sequence[int], plan: Plan, machine: dict[str, str]) -> CostProfile:
    started = time.perf_counter()
    lookup = getattr(engine, "prompt_lookup", False)
    if lookup:  # the cost of a step of r rows, not of r rows and guesses; the engine is given back as it came
        engine.use_prompt_lookup(False)
    try:
        read, decode = measure(engine, tokens, plan)
    finally:
        if lookup:
            engine.use_prompt_lookup(True)
    overhead = 0.0
    if plan.overhead_steps:
        decoder = getattr(engine, "tokenizer", None) or FakeDecoder()  # the text decoding a worker does
        overhead = round(step_overhead_ms(decoder, engine.num_slots, plan.overhead_steps, plan.tries), 3)
        log.info("worker loop: %.2f ms per step beside the engine", overhead)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return CostProfile(read, decode, {**machine, "measured_at": stamp,
                                      "measured_s": f"{time.perf_counter() - started:.1f}"}, overhead)


def prompt_tokens(engine: Engine, length: int) -> list[int]:
    """Real text's ids (any ids cost the same; these look like a prompt), repeated to `length`."""
    encode = getattr(engine.tokenizer, "encode", None)  # the fake engine (--engine fake) has none
    ids = encode(Path(__file__).read_text()) if encode else list(range(1, 1000))
    return (ids * (length // len(ids) + 1))[:length]
