"""Prompt slabs in bf16 or float32: what `engine.quants.blocks.slab_dtype` chooses between.

    .venv/bin/python -m bench.slab_dtype [--rows 64 128] [--rounds 5]

A prompt block's product with an unpacked slab of a quantized matrix (engine/quants/blocks.py
`QuantLinear._slabs`), timed as `F.linear` on 2 threads in each dtype, plus the slab's rounding
to bf16 (float32 needs none: the slab is unpacked to float32). On AVX2 alone oneDNN has no bf16
kernels, so bf16 is emulated; with AVX-512 or AMX it is native. Median of interleaved rounds.
Not asserted: the cores are shared."""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.head_speed import ms_per_call

SHAPES = [(2048, 2048), (4096, 2048), (2048, 8192)]  # (out, in): a 1.7B-class model's matrices


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    print(f"oneDNN bf16 kernels here: {native}; slab_dtype picks {'bfloat16' if native else 'float32'}")
    for rows in args.rows:
        for out, cols in SHAPES:
            x, w = torch.randn(rows, cols), torch.randn(out, cols)
            xb, wb = x.bfloat16(), w.bfloat16()
            runs = [(ms_per_call(lambda: F.linear(xb, wb), 5), ms_per_call(lambda: F.linear(x, w), 5),
                     ms_per_call(lambda: w.to(torch.bfloat16), 5))
                    for _ in range(args.rounds)]
            bf16, f32, rounding = (statistics.median(r[i] for r in runs) for i in range(3))
            print(f"{rows:4d} rows x [{out}, {cols}]: bf16 {bf16:7.2f} ms (+{rounding:.2f} rounding the slab), "
                  f"float32 {f32:7.2f} ms, bf16 / float32 {(bf16 + rounding) / f32:.2f}x", flush=True)


if __name__ == "__main__":
    main()
