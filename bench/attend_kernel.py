"""engine/attend.cpp's decode op against another revision's, both loaded in one process.

    .venv/bin/python -m bench.attend_kernel --baseline HEAD~1 [--spans 1500 4000] [--rows 1]
        [--threads 2] [--rounds 5] [--dtype float16 --baseline-dtype float32] [--shape smollm2-1.7b]

This VM's speed drifts by tens of percent between processes, which hid every earlier attempt at
this kernel, so both versions run in one: the working tree's attend.cpp and `--baseline`'s (`git
show`) are each compiled as build.py compiles it, under op names of their own
(`strata_attend_tree`, `strata_attend_base`), loaded together and called in turns. One decode
step's attention on SmolLM2-135M's layer shape (9 query heads over 3 KV heads of 64; `--shape
smollm2-1.7b`: 32 over 32), a pool of `--dtype` entries (float32; the baseline's
`--baseline-dtype`, by default the same), `--rows` rows of one token at `span` positions each (in
64-position blocks scattered over the pool), the pool of 8 layers (~200 MB in float32, beyond
the caches) taken in turn; the two outputs' bits are compared where both read the same pool.
Prints us a call per version and their ratio, per round. Not asserted (the cores are shared:
compare numbers of one run)."""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine import kv_dtype
from engine.quants.build import ATTEND_FLAGS, COMMON, _torch_flags, compiler

D, N, LAYERS = 64, 16384, 8
SHAPES = {"smollm2-135m": (3, 3), "smollm2-1.7b": (32, 1)}  # KV heads, query heads per KV head


def library(source: str, name: str, folder: Path) -> str:
    """attend.cpp's source compiled as build.py does, its ops registered as torch.ops.<name>."""
    src, out = folder / f"{name}.cpp", folder / f"{name}.so"
    src.write_text(source.replace("TORCH_LIBRARY(strata_attend,", f"TORCH_LIBRARY({name},")
                   .replace("TORCH_LIBRARY_IMPL(strata_attend,", f"TORCH_LIBRARY_IMPL({name},"))
    compile_flags, link = _torch_flags()
    engine = f"-I{Path(__file__).resolve().parent.parent / 'engine'}"  # attend.cpp's "quants/isa.h"
    subprocess.run([compiler(), *COMMON, *ATTEND_FLAGS, *compile_flags, engine, "-shared", str(src), "-o", str(out),
                    *link],
                   check=True)
    return str(out)


def places(span: int, g: torch.Generator, n: int, block: int = 64) -> torch.Tensor:
    """A row's positions as the pool holds them: runs of 64 in blocks scattered over its n places."""
    blocks = torch.randperm(n // block, generator=g)[:(span + block - 1) // block]
    return (blocks.view(-1, 1) * block + torch.arange(block)).flatten()[:span]


def micros(op, pools, q, read_at, mask, reps: int = 10) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    for _ in range(reps):
        for k, v in pools:
            out = op(q, k, v, read_at, mask, D**-0.5)
    return 1e6 * (time.perf_counter() - started) / (reps * len(pools)), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="git ref whose engine/attend.cpp is the baseline")
    parser.add_argument("--spans", type=int, nargs="+", default=[1500, 4000])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8"])
    parser.add_argument("--baseline-dtype", default=None, help="the baseline's pool (default: --dtype)")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    args = parser.parse_args()
    kv, groups = SHAPES[args.shape]
    n = N * 3 // kv  # the same ~200 MB of float32 pools whatever the heads
    root = Path(__file__).resolve().parent.parent
    base = subprocess.run(["git", "show", f"{args.baseline}:engine/attend.cpp"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        torch.ops.load_library(library(base, "strata_attend_base", Path(tmp)))
        torch.ops.load_library(library((root / "engine" / "attend.cpp").read_text(), "strata_attend_tree", Path(tmp)))
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(kv, n, D, generator=g), torch.randn(kv, n, D, generator=g)) for _ in range(LAYERS)]
    base_dtype = args.baseline_dtype or args.dtype
    stored = {name: [tuple(kv_dtype.store(p, getattr(torch, name)) for p in pair) for pair in pools]
              for name in {args.dtype, base_dtype}}
    print(f"{args.rows} row(s), {args.threads} thread(s), {args.shape}, pools {base_dtype} / {args.dtype}")
    print(f"{'span':>6} {'baseline us':>12} {'tree us':>9} {'ratio':>6}  same bits")
    for span in args.spans:
        read_at = torch.stack([places(span, g, n) for _ in range(args.rows)])
        q = torch.randn(args.rows, 1, kv * groups, D, generator=g)
        mask = torch.ones(args.rows, 1, span, dtype=torch.bool)
        for _ in range(args.rounds):
            b, want = micros(torch.ops.strata_attend_base.decode, stored[base_dtype], q, read_at, mask)
            t, got = micros(torch.ops.strata_attend_tree.decode, stored[args.dtype], q, read_at, mask)
            same = torch.equal(want, got) if base_dtype == args.dtype else "-"
            print(f"{span:>6} {b:12.0f} {t:9.0f} {b / t:5.2f}x  {same}")


if __name__ == "__main__":
    main()
