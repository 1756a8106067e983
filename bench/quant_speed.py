"""Speed and memory of a GGUF kept as its blocks (engine/quants), on a random-weight model of a
real shape (SmolLM2-1.7B's by default: 24 layers, dim 2048, hidden 8192, vocabulary 49 152),
written in one of llama.cpp's mixes (tests/helpers/quant_models.py's recipes):

    .venv/bin/python -m bench.quant_speed --mix Q4_K_M [--batches 1 4] [--steps 8]
    .venv/bin/python -m bench.quant_speed --kernels [--size 2048] [--batches 1 4]
        [--rows 49152] [--types Q6_K Q8_0] [--forms "float32 x"]

--kernels: the products alone, one thread (`--kernel-threads N`: N, wall time), per type: CPU time of a size x size product with
random blocks at each batch size through `strata_quants::mm` (int8 activations, the layers'
form; float32 activations, the head's; the portable build's int8 form; Q4_K's and Q6_K's also as
the loader holds them for the decode step, repacked eight rows at a time: `Q4_K_R8`, `Q6_K_R8`)
beside torch's int4 kernel
on the same shape (a Q4_K matrix repacked, as the loader does), the reference, measured in the
same run (median of interleaved rounds, so a load change hits all alike). --rows: the matrix's
output rows (default: size; 49152 x 2048 or x 576 is a vocabulary head's shape); --types and
--forms: only those (names as printed: `float32 x` is the head's form).

Model level (no tokenizer, no worker), eager, bench/step_timing.py's loop, CPU bf16 as `strata
serve` builds it (int4 for Q4_0/Q4_1 matrices without their bf16 prefill copy, which alone would
be 3.4 GB here: more than this shared machine gives one developer): decode tok/s at each batch size over 64 cached
tokens, prompt tok/s of one 128-token chunk, the weight bytes the model holds against the file's
tensor bytes, and RSS. The file is written once under the temporary folder and reused. Random
weights: speed only, the text means nothing. Not asserted; the cores are shared, so compare
numbers measured in one run."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from types import SimpleNamespace
from pathlib import Path

import torch

from bench.step_timing import measure
from engine.gguf_loader import GGUFModel
from engine.memory import release_freed_memory
from engine.model import Transformer
from engine.quants.blocks import held_bytes
from tests.helpers.quant_models import Shape, write_mix

# smollm2-135m's widths (576, 1536) are not multiples of 256: only mixes of 32-weight blocks fit it
# (--mix Q5_0 is what llama.cpp's Q4_K_M makes of it: Q5_0/Q5_1 layers, Q8_0 embedding and head)
SHAPES = {"smollm2-1.7b": Shape(dim=2048, hidden=8192, layers=24, heads=32, kv=32, vocab=49152),
          "smollm2-135m": Shape(dim=576, hidden=1536, layers=30, heads=9, kv=3, vocab=49152),
          "tiny": Shape()}
CONTEXT, PROMPT = 64, 128


def rss() -> str:
    """RSS, and of it the anonymous part and the mapped file's pages (shared, reclaimable)."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) / 1024
    return f"RSS {found['VmRSS']:.0f} MiB (anonymous {found['RssAnon']:.0f}, file pages {found['RssFile']:.0f})"


def kernels(size: int, batches: list[int], rounds: int = 7, rows: int | None = None,
            only_types: list[str] | None = None, forms: list[str] | None = None, threads: int = 1) -> None:
    """`threads` threads (one by default): each product's median time over `rounds` interleaved
    rounds (CPU time on one thread, wall time on more)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from engine.quants import blocks as quants
    from engine.gguf_loader import unpack_q4
    from engine.weights import Int4Blocks, Int4Linear
    from tests.helpers.quant_models import random_blocks

    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    rng = np.random.default_rng(0)
    ops = quants.ops()
    types = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_S]
    if only_types:
        types = [q for q in types if q.name in only_types]
    rows = rows or size
    raws = {q: torch.from_numpy(random_blocks(q, rows, size, rng)) for q in types}
    int4 = (Int4Linear(quants.unpack_q4_k(quants.QuantBlocks(raws[Q.Q4_K], Q.Q4_K, size)))
            if Q.Q4_K in raws else None)
    # Q4_0 / Q4_1 as the loader holds them where oneDNN prepacks bf16: torch's int4 kernel
    file_int4 = {q: Int4Linear(Int4Blocks(*(torch.from_numpy(np.ascontiguousarray(a)) for a in unpack_q4(
                     SimpleNamespace(qtype=q, shape=(rows, size), data=raws[q].numpy())))))
                 for q in (Q.Q4_0, Q.Q4_1) if q in raws}
    r8 = {q: ops.repack(raws[q], int(q), size) for q in quants.EIGHT_ROWS
          if q in raws and rows % 8 == 0 and quants.repack_here()}  # the loader's forms for the decode step
    calls: dict[tuple[str, str], object] = {}
    for batch in batches:
        x = torch.randn(batch, size)
        xb = x.to(torch.bfloat16)
        if int4 is not None and not forms:
            calls[("torch int4 (Q4_K repacked)", f"B={batch}")] = lambda xb=xb: int4(xb)
        for q in types:
            if q in file_int4 and (not forms or "torch int4" in forms):
                calls[(f"{q.name} torch int4", f"B={batch}")] = lambda xb=xb, q=q: file_int4[q](xb)
            for form, args in (("int8 x", (True, False)), ("float32 x", (False, False)), ("portable int8 x", (True, True))):
                if forms and form not in forms:
                    continue
                calls[(f"{q.name} {form}", f"B={batch}")] = (
                    lambda x=x, q=q, args=args: ops.mm(x, raws[q], int(q), quants.table(q), *args))
                if q in r8 and form == "int8 x":
                    calls[(f"{q.name}_R8 int8 x", f"B={batch}")] = (
                        lambda x=x, q=q: ops.mm(x, r8[q], quants.EIGHT_ROWS[q], quants.table(q), True, False))
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            started = clock()
            for _ in range(5):
                call()  # type: ignore[operator]
            times[key].append((clock() - started) / 5)
    names = dict.fromkeys(name for name, _ in calls)
    print(f"{rows}x{size} product, {threads} thread(s), {'CPU' if threads == 1 else 'wall'} ms (median of {rounds} "
          f"rounds of 5 calls); "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'':28}" + "".join(f"{f'B={b}':>10}" for b in batches))
    for name in names:
        row = [sorted(times[(name, f"B={b}")])[rounds // 2] * 1000 for b in batches]
        print(f"{name:28}" + "".join(f"{t:10.3f}" for t in row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mix", default="Q4_K_M")
    parser.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kernels", action="store_true", help="time the products alone (above)")
    parser.add_argument("--size", type=int, default=2048, help="--kernels: the square matrix's side")
    parser.add_argument("--rows", type=int, help="--kernels: the matrix's output rows (default: --size)")
    parser.add_argument("--types", nargs="+", help="--kernels: only these types (Q6_K Q8_0 ...)")
    parser.add_argument("--forms", nargs="+", help="--kernels: only these forms ('float32 x', 'int8 x', ...)")
    parser.add_argument("--rounds", type=int, default=7, help="--kernels: interleaved rounds")
    parser.add_argument("--kernel-threads", type=int, default=1, help="--kernels: torch threads (wall time when > 1)")
    args = parser.parse_args()
    if args.kernels:
        kernels(args.size, args.batches, args.rounds, args.rows, args.types, args.forms, args.kernel_threads)
        return
    torch.set_num_threads(args.threads)
    path = Path(tempfile.gettempdir()) / "strata-bench-cache" / f"random-{args.shape}-{args.mix}.gguf"
    path.parent.mkdir(exist_ok=True)
    if not path.exists():
        started = time.perf_counter()
        write_mix(path.with_suffix(".tmp"), args.mix, SHAPES[args.shape], quantize_small=False)
        path.with_suffix(".tmp").replace(path)
        print(f"wrote {path} in {time.perf_counter() - started:.0f}s")
    source = GGUFModel(path)
    file_bytes = sum(t.data.nbytes for t in source.file.tensors.values())
    started = time.perf_counter()
    model = Transformer.build(source.config, source, dtype=torch.bfloat16, device=torch.device("cpu"),
                              int4=True, prefill_bf16=False)
    load_s = time.perf_counter() - started
    release_freed_memory()  # as load_engine does
    source.file.drop_pages()
    held = held_bytes(model)
    slots = max(args.batches)
    assert CONTEXT + args.steps + 1 + PROMPT <= 255, "the cache holds 256 positions"
    model.allocate_cache(slots, 255)  # one decode span (256) of positions, ~100 MiB a slot at this shape
    print(f"{args.mix} {args.shape}: forms {model.forms}, load {load_s:.1f}s, held {held / 2**20:.0f} MiB "
          f"/ file tensors {file_bytes / 2**20:.0f} MiB = {held / file_bytes:.3f}x, {rss()}")
    decode, read = measure(model, args.batches, args.steps, CONTEXT, PROMPT)
    for batch, step in decode.items():
        print(f"  decode B={batch}: {step.per_second(batch):.2f} tok/s ({step.wall_s * 1000:.0f} ms a step wall, "
              f"{step.cpu_s * 1000:.0f} ms CPU (all threads), median of {args.steps})")
    print(f"  prompt: {read.per_second(PROMPT):.1f} tok/s (one {PROMPT}-token chunk; "
          f"{read.cpu_s * 1000 / PROMPT:.1f} ms CPU a token)")
    print(f"  after: {rss()}")


if __name__ == "__main__":
    main()
