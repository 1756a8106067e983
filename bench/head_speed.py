"""The vocabulary head of the default file, two ways, on the default's two threads:

    .venv/bin/python -m bench.head_speed [--batches 1 2 4 8 16] [--rounds 5]

- int8 copy: the file's Q8_0 rows requantized to int8 per row, torch's `_weight_int8pack_mm`
  with bf16 activations (the default head until Dec 5; still what a bf16 head becomes);
- file blocks: the file's own Q8_0 blocks times the float32 residual through engine/quants'
  `mm` (the default head since; exact, so a row that asks for logprobs needs no second pass).

Milliseconds a product at each batch size, median of interleaved rounds (a load change hits both
alike), and the bytes each form holds. Not asserted: the cores are shared."""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def ms_per_call(product, calls: int = 20) -> float:
    """Milliseconds one call of `product` takes, after one call to warm it."""
    product()
    started = time.perf_counter()
    for _ in range(calls):
        product()
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from engine.files import default_model_path
    from engine.gguf_loader import GGUFModel
    from engine.quants import blocks as quants
    from engine.weights import Int8Linear

    torch.set_num_threads(2)
    source = GGUFModel(default_model_path())
    held = source.quant("embed")
    assert held is not None, "the engine/quants kernels are not built (make install)"
    int8 = Int8Linear(source.dense("embed"))
    op, table = quants.ops(), quants.table(held.qtype)
    print(f"head [{held.raw.shape[0]}, {held.cols}] {held.qtype.name}: int8 copy {int8.q.nbytes / 2**20:.1f} MiB "
          f"(beside the file's blocks, which the tied embedding reads), file blocks {held.raw.nbytes / 2**20:.1f} MiB")
    with torch.inference_mode():
        for rows in args.batches:
            h = torch.randn(rows, held.cols) * 3
            x = h.to(torch.bfloat16)
            pairs = [(ms_per_call(lambda: int8(x)), ms_per_call(lambda: op.mm(h, held.raw, int(held.qtype), table)))
                     for _ in range(args.rounds)]
            int8_ms = statistics.median(p[0] for p in pairs)
            blocks_ms = statistics.median(p[1] for p in pairs)
            print(f"{rows:3d} rows: int8 copy {int8_ms:6.2f} ms, file blocks {blocks_ms:6.2f} ms, "
                  f"int8 / blocks {int8_ms / blocks_ms:.2f}x", flush=True)


if __name__ == "__main__":
    main()
