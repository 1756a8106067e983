"""What prompt lookup gives one request at a time, the engine alone (SmolLM2 Q4_1, the default
engine): tokens per decode step and tokens/s with it on and off, on chat answers of a few kinds,
and whether both gave the same tokens (they must). Then, over the same answers (decoded without
lookup), how often guesses were right when runs of n to LONGEST tokens are looked up, and the
guesses a shorter n adds (made only when no longer run matched): what sets engine/lookup.py's
SHORTEST (a guess costs its row, ~20 % of a one-row step); and after a run of LONGEST, how often
the second and third guesses were right when those before them were (engine/lookup.py's CHAIN).

    .venv/bin/python -m bench.prompt_lookup [--tokens 128] [--rounds 3] [--temperature 0.8 --top-p 0.95]

A one-row step with a guess runs two rows (~20 % more than one on this CPU; with three guesses,
four rows, ~70 % more); a confirmed guess saves a whole step. On and off alternate within each round, in one process, so the ratio is
measured under the same load; the median of the rounds is shown. End to end through HTTP (where
a step's Redis round trips are saved too): bench.side_by_side with --baseline.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.side_by_side import words
from engine.lookup import CHAIN, LONGEST, SHORTEST, Lookup

PROMPTS = {  # side_by_side asks round r's story of its first client
    **{f"side_by_side's story, round {r}": f"Story {r}-0: " + words(100 * r, 20) for r in range(3)},
    "summary": "Summarize in two sentences: The harbour authority closed the northern channel on Monday after "
               "a storm moved the reef markers. Ferries now use the southern channel, which adds twenty minutes "
               "to each crossing. The authority expects to reopen the northern channel on Friday, once divers "
               "have checked the markers and the lighthouse keeper has confirmed the signal works.",
    "code edit": "Rename the variable `x` to `total` in this function and return the code:\n\n"
                 "def add_all(values):\n    x = 0\n    for v in values:\n        x = x + v\n    return x\n",
    "list": "List the first twenty prime numbers, one per line.",
    "question": "What is the capital of France? Answer in one paragraph.",
}


def generate(engine, ids: list[int], tokens: int, params) -> tuple[list[int], int, float]:  # noqa: ANN001
    """Tokens, decode steps and seconds for one answer (ignoring end-of-text: fixed length)."""
    engine.begin(0, params)
    out = [engine.read(0, ids, sample=True)]
    steps = 0
    started = time.perf_counter()
    while len(out) < tokens:
        out += engine.decode([0], [out[-1]])[0]
        steps += 1
    return out[:tokens], steps, time.perf_counter() - started


def guesses(answers: list[tuple[list[int], list[int]]], shortest: int) -> list[tuple[int, int]]:
    """(prompt, answer) pairs -> (guesses right, guesses made) by a lookup of runs of `shortest`
    to LONGEST tokens, replaying each answer one step at a time: [0] the first guess of a step,
    [i] its (i+1)-th (after a run of LONGEST), counted when the ones before it were right."""
    counts = [[0, 0] for _ in range(CHAIN)]
    for prompt, answer in answers:
        lookup = Lookup(shortest=shortest)
        lookup.extend(prompt)
        for at, fed in enumerate(answer[:-1]):  # the step fed `fed` yields answer[at + 1]
            for i, (guess, following) in enumerate(zip(lookup.guess(fed), answer[at + 1:])):
                counts[i][1] += 1
                if guess != following:
                    break
                counts[i][0] += 1
            lookup.extend([fed])
    return [(right, made) for right, made in counts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from engine.protocol import SamplingParams
    from engine.load import load_engine

    engine = load_engine(None, num_slots=8, ctx=2048, cache_dir=Path(tempfile.gettempdir()) / "strata-bench-cache")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=7)
    table = Table(title=f"prompt lookup, one request, {args.tokens} tokens, temperature {args.temperature}"
                        f"{f', top_p {args.top_p}' if args.top_p < 1 else ''}; median of {args.rounds} rounds")
    for column in ("answer", "tokens a step", "tok/s off", "tok/s on", "on / off", "same tokens"):
        table.add_column(column, justify="left" if column == "answer" else "right")
    all_steps, all_tokens = 0, 0
    replayed: list[tuple[list[int], list[int]]] = []  # (prompt, answer without lookup)
    for name, content in PROMPTS.items():
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": content}])
        rates: dict[bool, list[float]] = {False: [], True: []}
        answers: dict[bool, list[int]] = {}
        steps = 0
        for round_ in range(args.rounds):
            for on in (False, True) if round_ % 2 == 0 else (True, False):
                engine.use_prompt_lookup(on)
                out, steps_taken, seconds = generate(engine, ids, args.tokens, params)
                rates[on].append((len(out) - 1) / seconds)
                answers[on] = out
                if on:
                    steps = steps_taken
        all_steps, all_tokens = all_steps + steps, all_tokens + args.tokens - 1
        replayed.append((ids, answers[False]))
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        table.add_row(name, f"{(args.tokens - 1) / steps:.2f}", f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}×",
                      "yes" if answers[True] == answers[False] else "NO")
    table.add_row("all", f"{all_tokens / all_steps:.2f}", "", "", "", "")
    console = Console(width=140)
    console.print(table)
    # what looking up shorter runs adds: the guesses made only when no longer run matched
    runs = Table(title="runs looked up, over these answers (decoded without lookup): guesses right")
    for column in ("runs of", "guesses", "right", "added by the shortest", "of those right"):
        runs.add_column(column, justify="right")
    chains = {n: guesses(replayed, n) for n in range(1, LONGEST + 1)}
    counts = {n: chain[0] for n, chain in chains.items()}
    for n, (right, made) in counts.items():
        more_right, more_made = (right - counts[n + 1][0], made - counts[n + 1][1]) if n < LONGEST else (right, made)
        runs.add_row(f"{n}-{LONGEST}", str(made), f"{right / max(made, 1):.0%}", str(more_made),
                     f"{more_right / max(more_made, 1):.0%}")
    console.print(runs)
    later = ", ".join(f"guess {i + 1} right {right / max(made, 1):.0%} of {made}"
                      for i, (right, made) in enumerate(chains[SHORTEST]) if i)
    console.print(f"after a run of {LONGEST}, when the guesses before it were right: {later}")


if __name__ == "__main__":
    main()
