"""Time to first token of requests that share a prompt prefix through the worker's KV pool: the
first reads a system prompt of PREFIX tokens and its question; two more with the same prefix and
other questions then take its cached blocks (workers/blocks.py) and read only their questions.
The default SmolLM2 engine, its pool as the worker runs it (BlockPool + engine tables).

    .venv/bin/python -m bench.prefix_reuse [--prefix 1500] [--rounds 3]

Prints the first's and the later ones' seconds (median of rounds) and their ratio: compare the
ratio, not the seconds (the 2 cores are shared)."""

from __future__ import annotations

import argparse
import statistics
import time

from engine import load_engine
from engine.protocol import SamplingParams
from workers.blocks import BlockPool

GREEDY = SamplingParams(temperature=0.0)


def first_token_s(engine, pool: BlockPool, slot: int, prompt: list[int], chunk: int = 256) -> float:
    """Admit, read what is not cached in chunks, sample the first token; then free the slot."""
    started = time.perf_counter()
    cached = pool.allocate(slot, prompt, 16, priority=0)
    table = pool.tables[slot]
    engine.assign(slot, table.blocks, table.tokens)
    engine.begin(slot, GREEDY, keep=cached)
    pos = cached
    while pos < len(prompt):
        piece = prompt[pos:pos + chunk]
        pool.grow(slot, pos + len(piece))
        engine.assign(slot, pool.tables[slot].blocks)
        engine.read(slot, piece, sample=pos + len(piece) == len(prompt))
        pool.write(slot, piece)
        pos += len(piece)
    took = time.perf_counter() - started
    pool.free(slot)
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = load_engine(None, num_slots=3, ctx=4096, kv_tokens=3 * 4096, compile=False, prompt_lookup=False)
    firsts, laters = [], []
    for r in range(args.rounds):
        pool = BlockPool(engine.kv_tokens, engine.kv_block)  # a fresh pool: nothing cached
        system = [(17 * i + 101 * r) % 40000 + 100 for i in range(args.prefix)]
        firsts.append(first_token_s(engine, pool, 0, system + [11, 12, 13, 14, 15]))
        laters += [first_token_s(engine, pool, 1, system + [21, 22, 23]),
                   first_token_s(engine, pool, 2, system + [31, 32, 33, 34])]
    first, later = statistics.median(firsts), statistics.median(laters)
    print(f"prefix {args.prefix} tokens: first request {first:.3f} s to its first token, "
          f"the next two {later:.3f} s each (median of {args.rounds} rounds): {later / first:.3f}x")


if __name__ == "__main__":
    main()
