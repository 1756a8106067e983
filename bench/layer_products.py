"""Where a one-row decode step's products go on the default file: layer 0's linears in the forms
the default engine gives them (torch's int4 kernel for the file's Q4_1 blocks), and engine/quants'
`mm` with int8 activations on the same blocks, at 2 and 1 threads.

    .venv/bin/python -m bench.layer_products [--calls 300]

Microseconds a call (after a warm-up) and G weights a second. Eager, engine alone, not asserted:
the cores are shared."""

from __future__ import annotations

import argparse

import torch

from bench.head_speed import ms_per_call

LINEARS = {"wqkv": ("q", "mixer.wqkv"), "wo": ("o", "mixer.wo"), "gate_up": ("gate", "ffn.w_gate_up"),
           "down": ("down", "ffn.w_down")}  # name: (a file part of it, the module in layer 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()

    from engine import load_engine
    from engine.files import default_model_path
    from engine.gguf_loader import GGUFModel
    from engine.quants import blocks as quants

    engine = load_engine(None, num_slots=1, ctx=256, threads=2, compile=False, prompt_lookup=False)
    layer, op = engine.model.layers[0], quants.ops()
    source = GGUFModel(default_model_path())
    with torch.inference_mode():
        for threads in (2, 1):
            torch.set_num_threads(threads)
            total = 0.0
            for name, (part, path) in LINEARS.items():
                module = layer.get_submodule(path)
                cols = 1536 if name == "down" else engine.model.cfg.dim
                x = torch.randn(1, 1, cols)
                us = ms_per_call(lambda: module(x.to(torch.bfloat16)), args.calls) * 1e3
                total += us
                held = source.quant(f"layers.0.{part}")
                assert held is not None, "the engine/quants kernels are not built (make install)"
                flat = x.reshape(1, -1)
                mm_us = ms_per_call(lambda: op.mm(flat, held.raw, int(held.qtype), quants.table(held.qtype), True),
                                    args.calls) * 1e3
                weights = held.raw.shape[0] * held.cols
                print(f"{threads} threads, {name:7s} {type(module).__name__}: {us:6.0f} us; mm int8 x on one {held.qtype.name} "
                      f"part [{held.raw.shape[0]}, {held.cols}]: {mm_us:6.0f} us ({weights / mm_us / 1e3:.2f} G weights/s)",
                      flush=True)
            print(f"{threads} threads: layer 0's products {total:.0f} us, x {engine.model.cfg.n_layers} layers "
                  f"{total * engine.model.cfg.n_layers / 1e3:.1f} ms a step", flush=True)


if __name__ == "__main__":
    main()
