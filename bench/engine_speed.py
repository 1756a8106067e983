"""SmolLM2 engine speed: decode tok/s at 1 and 4 slots, prompt tok/s, time to first token, RSS.

    .venv/bin/python -m bench.engine_speed [--dtypes float32 bfloat16 float32+int4 bfloat16+int4] [--steps 64]

Each variant runs in its own process so its resident memory is its own. "+int4" loads with
int4_decode=True: decode steps of <= 8 rows use int4 weights from the file's Q4_1 blocks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

DECODE_CONTEXT = 200
PREFILL_TOKENS = 2000
PREFILL_CHUNK = 512
TTFT_TOKENS = 100


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(variant: str, steps: int, threads: int | None) -> dict[str, float]:
    from engine.protocol import SamplingParams
    from engine.runner import load_engine

    dtype, _, extra = variant.partition("+")
    engine = load_engine(None, num_slots=4, ctx=2048 + 64, dtype=dtype, threads=threads, int4_decode=extra == "int4")
    filler = engine.tokenizer.encode("The history of the lighthouse keepers of the northern coast. " * 400)
    greedy = SamplingParams(temperature=0.0)

    def decode_rate(num_slots: int) -> float:
        slots = list(range(num_slots))
        last = {}
        for s in slots:
            engine.begin(s, greedy)
            last[s] = engine.read(s, filler[s : s + DECODE_CONTEXT], sample=True)
        for _ in range(4):  # warm-up
            for s, t in zip(slots, engine.decode(slots, [last[s] for s in slots])):
                last[s] = t
        start = time.perf_counter()
        for _ in range(steps):
            for s, t in zip(slots, engine.decode(slots, [last[s] for s in slots])):
                last[s] = t
        return steps * num_slots / (time.perf_counter() - start)

    def prefill_rate() -> float:
        engine.begin(0, greedy)
        ids = filler[:PREFILL_TOKENS]
        start = time.perf_counter()
        for i in range(0, len(ids), PREFILL_CHUNK):
            engine.read(0, ids[i : i + PREFILL_CHUNK], sample=i + PREFILL_CHUNK >= len(ids))
        return len(ids) / (time.perf_counter() - start)

    def ttft_ms() -> float:
        best = float("inf")
        for attempt in range(3):
            engine.begin(1, greedy)
            start = time.perf_counter()
            engine.read(1, filler[attempt : attempt + TTFT_TOKENS], sample=True)
            best = min(best, time.perf_counter() - start)
        return best * 1000

    decode_rate(1)  # warm the allocator and kernels
    return {
        "decode_b1": decode_rate(1),
        "decode_b4": decode_rate(4),
        "prefill": prefill_rate(),
        "ttft_ms": ttft_ms(),
        "rss_mib": _rss_mib(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float32+int4", "bfloat16+int4"])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(measure(args.dtypes[0], args.steps, args.threads)))
        return

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"SmolLM2-135M Q4_1 (dequantized; +int4: int4 decode weights), decode at ~{DECODE_CONTEXT} tokens of context")
    table.add_column("dtype", no_wrap=True)
    for column in ("decode B=1 tok/s", "decode B=4 tok/s (total)", f"prompt tok/s ({PREFILL_TOKENS}, chunks of {PREFILL_CHUNK})", f"TTFT {TTFT_TOKENS} tok (ms)", "RSS (MiB)"):
        table.add_column(column, justify="right")
    for dtype in args.dtypes:
        cmd = [sys.executable, "-m", "bench.engine_speed", "--child", "--dtypes", dtype, "--steps", str(args.steps)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        table.add_row(
            dtype, f"{result['decode_b1']:.1f}", f"{result['decode_b4']:.1f}", f"{result['prefill']:.0f}",
            f"{result['ttft_ms']:.0f}", f"{result['rss_mib']:.0f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
