"""The prompt's float32 product on AVX2 alone: `strata_quants::prompt_mm` against what it replaced;
with --int8, the integer product of machines without AMX (`prompt_mm_int8`) against the bf16
slabs it replaced on AVX-512 VNNI, or on AVX2 alone against `prompt_mm`'s float32; with --copy, `prompt_mm_int8` on the blocks as the engine holds
them (repacked eight rows at a time: `repacked`) against the bf16 copy of the matrix that Q4_0 /
Q4_1 prompts went through before (oneDNN's prepacked weights, `PackedLinear`; on AVX-512 BF16
their tile is prompt_bf16.cpp's).

    .venv/bin/python -m bench.prompt_product [--types Q4_0 Q4_K] [--rows 1 16 64 80 512]
        [--shape 8192 2048] [--threads 2] [--rounds 3] [--int8 [--repacked] | --copy]

A random matrix of one type (tests/helpers/quant_models.py `random_blocks`), `rows` prompt tokens,
GFLOP/s of: `prompt_mm` (one call for all the rows; prompt.cpp), and the float32 slabs it replaced
on AVX2 (the matrix unpacked ~8 MB of rows at a time, each unpacked slab multiplied by each
64-row piece with MKL's `F.linear`, as `QuantLinear._slabs` did before: a piece had to be its own
call; --int8: bf16 slabs, oneDNN's product, as `QuantLinear._slabs` does where `int8_prompt` is
false). `rows` 1 shows the unpacking's own cost. Median of interleaved rounds; not asserted (the
cores are shared: compare numbers of one run)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.quants import blocks as quants
from tests.helpers.quant_models import random_blocks

SLAB_BYTES = 8 << 20


def slabs(x: torch.Tensor, blocks: quants.QuantBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The former prompt product: slabs unpacked once, each 64-row piece its own call."""
    pieces = [p.to(dtype) for p in x.split(64)]
    rows = blocks.raw.shape[0]
    step = max(1, SLAB_BYTES // (4 * blocks.cols))
    outs = [torch.empty(p.shape[0], rows) for p in pieces]
    for lo in range(0, rows, step):
        slab = quants.dequantize(blocks._replace(raw=blocks.raw[lo:lo + step]), dtype)
        for p, out in zip(pieces, outs):
            out[:, lo:lo + step] = F.linear(p, slab)
    return torch.cat(outs)


def seconds(fn, calls: int = 2) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def products(args: argparse.Namespace, blocks: quants.QuantBlocks) -> tuple[Callable, Callable, str, str]:
    """The product measured and the one it is compared with, each x -> y, and their names."""
    qtype = blocks.qtype
    if args.copy:
        from engine.weights import PackedLinear

        held = quants.repacked(blocks)
        copy = PackedLinear(quants.dequantize(held, torch.float32))
        return (lambda x: quants.ops().prompt_mm_int8(x, held.raw, quants.code(held), quants.table(qtype)), copy,
                f"{quants.kind(held)} blocks", "bf16 copy")
    op = quants.ops().prompt_mm_int8 if args.int8 else quants.ops().prompt_mm
    if args.int8 and quants.slab_dtype() == torch.float32:  # AVX2 alone: it replaced prompt_mm's float32
        held = quants.repacked(blocks) if args.repacked else blocks

        def float32(x: torch.Tensor) -> torch.Tensor:
            return quants.ops().prompt_mm(x, blocks.raw, int(qtype), quants.table(qtype))
        return (lambda x: op(x, held.raw, quants.code(held), quants.table(qtype)), float32,
                f"prompt_mm_int8 ({quants.kind(held)})", f"prompt_mm ({quants.kind(blocks)})")
    dtype = torch.bfloat16 if args.int8 else torch.float32
    return (lambda x: op(x, blocks.raw, int(qtype), quants.table(qtype)), lambda x: slabs(x, blocks, dtype),
            op.__name__.split(".")[-1], f"{dtype} slabs")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 80, 512])
    parser.add_argument("--shape", type=int, nargs=2, default=[8192, 2048], metavar=("OUT", "IN"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--int8", action="store_true", help="prompt_mm_int8 against bf16 slabs (AVX-512 VNNI) or "
                        "prompt_mm (AVX2 alone)")
    parser.add_argument("--repacked", action="store_true", help="with --int8 on AVX2 alone: prompt_mm_int8 on the "
                        "blocks as the engine holds them (repacked eight rows at a time)")
    parser.add_argument("--copy", action="store_true", help="prompt_mm_int8 on the repacked blocks against a prepacked "
                        "bf16 copy (AVX-512 VNNI)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out, cols = args.shape
    rng = np.random.default_rng(0)
    print(f"[{out}, {cols}], {args.threads} threads; GFLOP/s, median of {args.rounds} interleaved rounds")
    for name in args.types:
        qtype = Q[name]
        blocks = quants.QuantBlocks(torch.from_numpy(random_blocks(qtype, out, cols, rng)), qtype, cols)
        ours, theirs, our_name, their_name = products(args, blocks)
        for rows in args.rows:
            x = torch.randn(rows, cols)
            flops = 2 * rows * out * cols
            runs = [(seconds(lambda: ours(x)), seconds(lambda: theirs(x))) for _ in range(args.rounds)]
            new, old = (statistics.median(r[i] for r in runs) for i in range(2))
            print(f"{name:6s} {rows:4d} rows: {our_name} {flops / new / 1e9:6.1f}  "
                  f"{their_name} {flops / old / 1e9:6.1f}  ({old / new:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
