"""What choosing a token costs per step (engine/sampling.py `sample_tokens`), on SmolLM2's
vocabulary size, beside the model's step: greedy, temperature, top_p, top_k + top_p, at 1 and 8
rows. Logits are random but shaped like a language model's (a few tokens far ahead), so top_p
finds its nucleus among the largest few as it does on real text.

    .venv/bin/python -m bench.sampling [--baseline REF] [--repeats 200]

`--baseline REF` times the sampler of another commit too (a temporary worktree), in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VOCAB = 49_152
CASES = {  # name -> SamplingParams fields
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.8, top_k 40, top_p 0.95": {"temperature": 0.8, "top_k": 40, "top_p": 0.95},
}
ROWS = (1, 8)


def measure(repeats: int) -> dict[str, float]:
    """ms per step, by "case @ rows"."""
    import torch

    from engine.protocol import SamplingParams
    from engine.sampling import SlotSampler, sample_tokens

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(max(ROWS), VOCAB, generator=generator) * 2
    logits[:, :20] += 12  # a handful of likely tokens, as after a real prompt
    out = {}
    for name, fields in CASES.items():
        for rows in ROWS:
            samplers = [SlotSampler.start(SamplingParams(seed=i, **fields)) for i in range(rows)]
            sample_tokens(logits[:rows], samplers, frozenset())
            started = time.perf_counter()
            for _ in range(repeats):
                sample_tokens(logits[:rows], samplers, frozenset())
            out[f"{name} @ {rows}"] = 1000 * (time.perf_counter() - started) / repeats
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, metavar="REF")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child: print the numbers
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.repeats)))
        return

    from rich.console import Console
    from rich.table import Table

    from bench.baseline import checkout

    def child(tree: str) -> dict[str, float]:
        # this file run with the other tree's `engine` first on the path
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", "--repeats", str(args.repeats)],
                              env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with checkout(args.baseline) as worktree:
        runs = {"this tree": child(here)}
        if worktree is not None:
            runs[args.baseline] = child(str(worktree))
    table = Table(title=f"sample_tokens, ms per step (vocabulary {VOCAB}, {args.repeats} steps each)")
    table.add_column("case")
    for name in runs:
        table.add_column(name, justify="right")
    if args.baseline:
        table.add_column(f"{args.baseline} / this tree", justify="right")
    for key in runs["this tree"]:
        cells = [f"{r[key]:.3f}" for r in runs.values()]
        if args.baseline:
            cells.append(f"{runs[args.baseline][key] / runs['this tree'][key]:.1f}×")
        table.add_row(key, *cells)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
