"""What choosing a token costs per step (engine/sampling.py `sample_tokens`), beside the model's
step: greedy, temperature, top_p, top_k + top_p, at 1 and 8 rows. The logits are SmolLM2's own
(the default engine decoding side_by_side's three stories, sampled at temperature 0.8 and top_p
0.95: ~380 steps), so top_p meets the nuclei real text has, which made-up logits did not: the bench
prints their sizes, and how often the first floor of engine/sampling.py held them.

    .venv/bin/python -m bench.sampling [--baseline REF] [--repeats 3]

`--baseline REF` times the sampler of another commit too (a temporary worktree), in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 381  # 3 stories of 128 tokens: the first of each comes from reading the prompt
CASES = {  # name -> SamplingParams fields
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},  # bench.side_by_side's sampled runs
    "temperature 0.8, top_k 40, top_p 0.95": {"temperature": 0.8, "top_k": 40, "top_p": 0.95},
}
ROWS = (1, 8)


def capture(path: str) -> None:
    """Save the logits of every decode step of the stories (one row each)."""
    import torch

    from bench.prompt_lookup import PROMPTS, generate
    from engine import runner
    from engine.load import load_engine
    from engine.protocol import SamplingParams

    engine = load_engine(None, num_slots=8, ctx=2048, cache_dir=Path(tempfile.gettempdir()) / "strata-bench-cache")
    engine.use_prompt_lookup(False)
    rows: list = []
    choose = runner.sample_tokens

    def keep(logits, samplers, eos, reported=None):  # noqa: ANN001, ANN202
        rows.append(logits.detach().clone())
        return choose(logits, samplers, eos, reported)

    runner.sample_tokens = keep
    try:
        for story, content in enumerate(v for k, v in PROMPTS.items() if "story" in k):
            prompt = engine.tokenizer.encode_chat([{"role": "user", "content": content}])
            generate(engine, prompt, 128, SamplingParams(temperature=0.8, top_p=0.95, seed=story))
    finally:
        runner.sample_tokens = choose
    torch.save(torch.cat([r for r in rows if r.shape[0] == 1]), path)


def nuclei(logits_path: str, temperature: float = 0.8, top_p: float = 0.95) -> str:
    """What top_p meets on these logits: the nucleus's size (median, 90th percentile, largest, how
    often over 256: where the sampler before 6288fed fell back to topk(4096)) and in how many steps
    the tokens of probability 1e-4 or more (engine/sampling.py's first floor) hold top_p."""
    import torch

    from engine.sampling import NUCLEUS_FLOORS

    probs = torch.softmax(torch.load(logits_path) / temperature, dim=-1)
    ordered = torch.sort(probs, dim=-1, descending=True).values
    sizes = sorted(int(n) for n in ((ordered.cumsum(-1) - ordered) < top_p).sum(-1))
    enough = int(((probs * (probs >= NUCLEUS_FLOORS[0])).sum(-1) >= top_p).sum())
    return (f"temperature {temperature}, top_p {top_p}: nucleus of {sizes[len(sizes) // 2]} tokens at the median, "
            f"{sizes[int(0.9 * len(sizes))]} at the 90th percentile, {sizes[-1]} at most, over 256 in "
            f"{sum(n > 256 for n in sizes)} steps; the tokens of "
            f"probability {NUCLEUS_FLOORS[0]:g} or more hold top_p in {enough} of {len(sizes)} steps")


def measure(logits_path: str, repeats: int) -> dict[str, float]:
    """ms per step, by "case @ rows": every captured row once per repeat, `rows` at a time."""
    import torch

    from engine.protocol import SamplingParams
    from engine.sampling import SlotSampler, sample_tokens

    logits = torch.load(logits_path)
    out = {}
    for name, fields in CASES.items():
        for rows in ROWS:
            samplers = [SlotSampler.start(SamplingParams(seed=i, **fields)) for i in range(rows)]
            batches = [logits[i:i + rows] for i in range(0, logits.shape[0] - rows + 1, rows)]
            sample_tokens(batches[0], samplers, frozenset())
            started = time.perf_counter()
            for _ in range(repeats):
                for batch in batches:
                    sample_tokens(batch, samplers, frozenset())
            out[f"{name} @ {rows}"] = 1000 * (time.perf_counter() - started) / (repeats * len(batches))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, metavar="REF")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the captured steps")
    parser.add_argument("--json", metavar="LOGITS", help=argparse.SUPPRESS)  # a child: print the numbers
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.json, args.repeats)))
        return

    from rich.console import Console
    from rich.table import Table

    from bench.baseline import checkout, env_with_first

    logits = os.path.join(tempfile.mkdtemp(prefix="strata-sampling-"), "logits.pt")
    capture(logits)
    seen = nuclei(logits)

    def child(tree: str) -> dict[str, float]:
        # this file run with the other tree's `engine` first on the path
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", logits, "--repeats", str(args.repeats)],
                              env=env_with_first(tree), capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with checkout(args.baseline) as worktree:
            runs = {"this tree": child(here)}
            if worktree is not None:
                runs[args.baseline] = child(str(worktree))
    finally:
        shutil.rmtree(os.path.dirname(logits), ignore_errors=True)
    table = Table(title=f"sample_tokens, ms per step (SmolLM2's logits of {STEPS} steps, {args.repeats} passes)")
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
    console = Console(width=140)
    console.print(table)
    console.print(seen)


if __name__ == "__main__":
    main()
