"""What reading K/V through the pool's block tables costs a decode step, in one process, on the
default SmolLM2 file, eager: the step itself, and beside it the step's own reads alone, timed in
turns so the shared cores' load hits all of them alike.

    .venv/bin/python -m bench.kv_read [--batches 1 4 8] [--context 200] [--rounds 30]

For each batch size B (B slots, each with a `--context`-token prompt read; each slot its own run
of blocks, as a fresh pool and the contiguous cache have them), per round:
- `step`: one eager decode step of the B rows (the engine as served, --no-compile): its rows'
  blocks are runs equally spaced, so it reads them as one strided view of each pool
  (`Transformer.kv_view`);
- `gathered`: the same step made to gather instead (`kv_view` None: rows whose blocks are
  scattered, e.g. a shared prefix);
- `index_select`: every layer's K and V gathered as the gathering step does (engine/layers.py:
  `index_select` on the flattened pool), with the step's own `read_at`;
- `advanced`: the same rows by advanced indexing `pool[heads, read_at]` (the pool's first read);
- `view`: the contiguous cache's read before the pool, a view of each slot's rows (a run of
  slots is one view; B scattered rows would have been a gather too);
- `bf16`, `int8`: the gather and conversion to float32 from a `--kv-dtype` bfloat16 / int8 pool
  of the same entries (engine/kv_dtype.py).
The step against the contiguous cache is estimated as `gathered - index_select + view`: the pool
changes only how the rows are read (the write is one index-put either way), so `estimate / step`
is what the pool costs decode as served, `estimate / gathered` what it costs rows in scattered
blocks, and with `advanced` in place of `index_select` what its first read cost. Medians over
the rounds. (bench.engine_speed --baseline f2bf933 measures the old engine itself.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import kv_dtype


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    from engine.load import load_engine
    from engine.protocol import SamplingParams

    slots = max(args.batches)
    engine = load_engine(None, num_slots=slots, ctx=2048 + 64, compile=False, prompt_lookup=False)
    model = engine.model
    seen = []
    step_inputs = model.step_inputs
    model.step_inputs = lambda index: seen.append(step_inputs(index)) or seen[-1]  # the step's own read_at
    layers = [b.mixer for b in model.layers if hasattr(b.mixer, "k_cache")]
    narrow = {name: [(kv_dtype.store(m.k_cache.float(), getattr(torch, name)),
                      kv_dtype.store(m.v_cache.float(), getattr(torch, name))) for m in layers]
              for name in ("bfloat16", "int8")}
    prompt = [(37 * i + 11) % 4000 + 100 for i in range(args.context)]
    rows: list[tuple[int, dict[str, float]]] = []
    for batch in args.batches:
        last = []
        for slot in range(batch):
            engine.begin(slot, SamplingParams(temperature=0.0))
            last.append(engine.read(slot, prompt, sample=True))
        engine.decode(list(range(batch)), last)
        read_at = seen[-1].read_at
        span, hd, kv = read_at.shape[1], layers[0].head_dim, layers[0].n_kv_heads
        pool = layers[0].k_cache.shape[1]
        flat = (read_at.unsqueeze(1) + torch.arange(kv).view(1, -1, 1) * pool).reshape(-1)
        heads, at = torch.arange(kv).view(1, -1, 1), read_at.unsqueeze(1)
        starts = read_at[:, 0].tolist()

        def isel(buffers):
            for k, v in buffers:
                for t in (k, v):
                    kv_dtype.load(t.view(-1, t.shape[-1]).index_select(0, flat).view(batch, kv, span, -1), hd)

        def advanced():
            for m in layers:
                m.k_cache[heads, at], m.v_cache[heads, at]

        def view():
            for m in layers:
                for t in (m.k_cache, m.v_cache):
                    [t[:, s:s + span] for s in starts]

        def step():
            engine.decode(list(range(batch)), last)

        def gathered():
            model.kv_view = lambda index: None
            try:
                step()
            finally:
                del model.kv_view  # the class's own again

        runs = {"step": step, "gathered": gathered, "index_select": lambda: isel([(m.k_cache, m.v_cache) for m in layers]),
                "advanced": advanced, "view": view, "bf16": lambda: isel(narrow["bfloat16"]),
                "int8": lambda: isel(narrow["int8"])}
        times: dict[str, list[float]] = {name: [] for name in runs}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name, fn in runs.items():
                    times[name].append(_timed(fn))
        rows.append((batch, {name: statistics.median(t) * 1e3 for name, t in times.items()}))

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode step reads, eager, {args.context}-token contexts, {model.cfg.n_layers} layers; "
                        f"median of {args.rounds} interleaved rounds, ms")
    for column in ("B", "step (view)", "step gathered", "gather: index_select", "advanced", "view", "bf16 pool",
                   "int8 pool", "pool vs contiguous", "gathered vs contiguous", "first pool vs contiguous"):
        table.add_column(column, justify="right")
    for batch, t in rows:
        old = t["gathered"] - t["index_select"] + t["view"]
        table.add_row(str(batch), f"{t['step']:.1f}", f"{t['gathered']:.1f}", f"{t['index_select']:.2f}",
                      f"{t['advanced']:.2f}", f"{t['view']:.2f}", f"{t['bf16']:.2f}", f"{t['int8']:.2f}",
                      f"{old / t['step']:.2f}x", f"{old / t['gathered']:.2f}x",
                      f"{old / (old - t['view'] + t['advanced']):.2f}x")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
