"""How long torch's OpenMP threads should spin before they sleep (`GOMP_SPINCOUNT`), measured on
the default engine: decode tok/s at 1, 4 and 8 rows and prompt tok/s, one process per setting
(libgomp reads the setting once, when it loads), on quiet cores and beside CPU hogs.

    .venv/bin/python -m bench.openmp_spin [--spins passive 1000 2000 5000 20000 active] [--hogs 0 2]

`--hogs 2` runs the same settings again beside two busy-looping processes at the same
priority: what happens when anything else wants the cores (another job, a test run). Spinning
long wins alone and collapses beside hogs; sleeping at once is safe but halves a quiet step.
The engine's own default is whatever `engine/__init__.py` sets (docs/engine.md)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

MEASURE = """
import json, sys, time
from engine import SamplingParams, load_engine
eng = load_engine(None, num_slots=8, ctx=2048, cache_dir=sys.argv[1], compile=sys.argv[2] == "compile")
out = {}
for rows in (1, 4, 8):
    for s in range(rows):
        eng.begin(s, SamplingParams(temperature=0))
        eng.read(s, list(range(100, 300)), sample=True)
    slots = list(range(rows))
    for _ in range(5):
        eng.decode(slots, [5] * rows)
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < 3:
        eng.decode(slots, [5] * rows)
        steps += 1
    out[f"decode_b{rows}"] = steps * rows / (time.perf_counter() - started)
started = time.perf_counter()
eng.begin(0, SamplingParams(temperature=0))
for chunk in range(4):
    eng.read(0, list(range(100, 612)), sample=chunk == 3)
out["prompt"] = 2048 / (time.perf_counter() - started)
print(json.dumps(out))
"""


def hog(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def environment(spin: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if spin in ("passive", "active"):
        env["OMP_WAIT_POLICY"] = spin.upper()
    else:
        env["GOMP_SPINCOUNT"] = spin
    return env


def measure(spin: str, cache_dir: str, compiled: bool) -> dict[str, float]:
    argv = [sys.executable, "-c", MEASURE, cache_dir, "compile" if compiled else "eager"]
    done = subprocess.run(argv, env=environment(spin), capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        return {"failed": float(done.returncode)}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spins", nargs="+", default=["passive", "1000", "2000", "5000", "20000", "active"],
                        help="GOMP_SPINCOUNT values, or passive / active (OMP_WAIT_POLICY)")
    parser.add_argument("--hogs", nargs="+", type=int, default=[0, 2], help="busy processes beside the engine")
    parser.add_argument("--eager", action="store_true", help="eager decode instead of the compiled default")
    parser.add_argument("--cache-dir", default="/tmp/strata-bench-cache")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    table = Table(title="SmolLM2 Q4_1 default engine, tok/s by OpenMP wait setting (one process each)")
    for column in ("hogs", "setting", "decode B=1", "B=4", "B=8", "prompt"):
        table.add_column(column)
    for hogs in args.hogs:
        for spin in args.spins:
            busy = [multiprocessing.Process(target=hog, args=(900,), daemon=True) for _ in range(hogs)]
            for process in busy:
                process.start()
            try:
                row = measure(spin, args.cache_dir, compiled=not args.eager)
            finally:
                for process in busy:
                    process.terminate()
            print(hogs, spin, json.dumps(row), flush=True)
            cells = [f"{row[k]:.0f}" if k in row else "failed" for k in ("decode_b1", "decode_b4", "decode_b8", "prompt")]
            table.add_row(str(hogs), spin, *cells)
    Console().print(table)


if __name__ == "__main__":
    main()
