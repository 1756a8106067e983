"""What a grammar costs (engine/grammar.py): decode tokens/s of json_schema requests against free
ones at 1 and 4 slots, on the default engine, in one run; and the compile time of a
20-property schema, first and cached.

    .venv/bin/python -m bench.grammar_speed [--steps 48] [--eager] [--repeats 2]

Each case starts every slot with the same greedy prompt (constrained rows with the schema
below; free rows without), reads the prompts, then times up to `--steps` decode steps, until a
row's answer ends (every timed step has all its rows); free and constrained runs alternate.
Two measures. The step (the issue's "constrained step <= 1.15x the free one"): at each position
of a constrained answer the same rows decode twice from the same cache, once free and once
constrained (`begin(..., keep=position)`, the grammar replayed to that point), in alternating
order, prompt lookup off (one token a row a step); the ratio is the median of the pairs' ratios,
so the load of a shared machine hits both halves of a pair alike. And tokens/s as served, whole
runs alternating (free rows of the default engine take prompt lookup at one slot; constrained
rows never do). Not asserted anywhere: compare the ratios of one run."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = "Write a long story about a lighthouse keeper, as JSON."
STORY = {"type": "object", "additionalProperties": False, "required": ["title", "story"], "properties": {
    "title": {"type": "string"}, "story": {"type": "string"}}}
WIDE = {"type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(20)],
        "properties": {f"field_{i}": ({"type": "string", "maxLength": 40} if i % 3 == 0 else
                                      {"type": "integer"} if i % 3 == 1 else
                                      {"type": "array", "items": {"type": "number"}}) for i in range(20)}}


def decode_run(engine, slots: int, grammar: str | None, steps: int) -> float:  # noqa: ANN001
    """Tokens/s over up to `steps` decode steps of `slots` rows, stopping when any row's answer
    ends (so every timed step has all the rows)."""
    from engine.protocol import SamplingParams

    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    last = {}
    for slot in range(slots):
        engine.begin(slot, SamplingParams(temperature=0.0, grammar=grammar))
        last[slot] = engine.read(slot, prompt, sample=True)
    produced, times = 0, []
    for _ in range(steps):
        if any(token in engine.eos_token_ids for token in last.values()):
            break
        started = time.perf_counter()
        out = engine.decode(list(last), list(last.values()))
        times.append(time.perf_counter() - started)
        for slot, new in zip(list(last), out):
            last[slot] = new[-1]
            produced += len(new)
    return produced / sum(times)


def paired_steps(engine, slots: int, grammar: str, steps: int) -> list[tuple[float, float]]:  # noqa: ANN001
    """(free s, constrained s) of the same rows' decode step at each position of the constrained
    answer, the two in alternating order."""
    from engine.protocol import SamplingParams

    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    rows = list(range(slots))
    last, answers = {}, {slot: [] for slot in rows}
    for slot in rows:
        engine.begin(slot, SamplingParams(temperature=0.0, grammar=grammar))
        last[slot] = engine.read(slot, prompt, sample=True)
        answers[slot].append(last[slot])
    pairs = []
    for step in range(steps):
        if any(token in engine.eos_token_ids for token in last.values()):
            break
        position = engine.position(0)
        timed = {}
        for constrained in ((False, True) if step % 2 else (True, False)):
            for slot in rows:
                params = SamplingParams(temperature=0.0, grammar=grammar, grammar_done=tuple(answers[slot])) \
                    if constrained else SamplingParams(temperature=0.0)
                engine.begin(slot, params, keep=position)  # the grammar's replay is untimed; its mask is the step's
            started = time.perf_counter()
            out = engine.decode(rows, [last[slot] for slot in rows])
            timed[constrained] = time.perf_counter() - started
            if constrained:
                new = {slot: tokens[-1] for slot, tokens in zip(rows, out)}
        pairs.append((timed[False], timed[True]))
        for slot in rows:
            answers[slot].append(new[slot])
        last = new
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="decode eagerly (default: compiled, as served)")
    args = parser.parse_args()

    from engine.load import load_engine
    from engine.grammar import Grammars
    from shapes.constraints import schema_grammar

    cache = Path(tempfile.gettempdir()) / "strata-bench-cache"
    engine = load_engine(None, num_slots=4, ctx=1024, cache_dir=cache, compile=not args.eager)
    tok = engine.tokenizer
    assert tok is not None

    grammars = Grammars(tok.json, engine.config.vocab_size, sorted(engine.eos_token_ids), tok.decode)
    started = time.perf_counter()
    grammars.compiled(schema_grammar({"type": "object"}))
    tokenizer_s = time.perf_counter() - started
    wide = schema_grammar(WIDE)
    compiled = []
    for _ in range(2):  # the first compiles, the second is the cache's
        started = time.perf_counter()
        grammars.compiled(wide)
        compiled.append(time.perf_counter() - started)
    started = time.perf_counter()
    grammars.constraint(wide).allowed()  # llguidance compiles lazily: the first mask does some of the work
    first_mask = time.perf_counter() - started
    grammars.close()
    print(f"llguidance tokenizer (first grammar): {tokenizer_s * 1000:.0f} ms")
    print(f"20-property schema: compiled in {compiled[0] * 1000:.2f} ms, from the cache in {compiled[1] * 1000:.3f} ms; "
          f"a request's copy and first mask {first_mask * 1000:.2f} ms")

    story = schema_grammar(STORY)
    results = {}
    lookup = engine.prompt_lookup
    print(f"decode: {'compiled' if engine.compiled is not None else 'eager'}, prompt lookup {'on' if lookup else 'off'}")
    for slots in (1, 4):
        if lookup:
            engine.use_prompt_lookup(False)
        pairs = []
        for _ in range(args.repeats):
            pairs += paired_steps(engine, slots, story, args.steps)
        if lookup:
            engine.use_prompt_lookup(True)
        results[(slots, "free", "ms")] = statistics.median(f for f, _ in pairs) * 1000
        results[(slots, "json_schema", "ms")] = statistics.median(c for _, c in pairs) * 1000
        results[(slots, "paired", "ratio")] = statistics.median(c / f for f, c in pairs)
        print(f"{slots} slot(s), paired steps: free {results[(slots, 'free', 'ms')]:.1f} ms, json_schema "
              f"{results[(slots, 'json_schema', 'ms')]:.1f} ms (medians of {len(pairs)}); the constrained step "
              f"costs {results[(slots, 'paired', 'ratio')]:.2f}x the free one (median of the pairs' ratios)")
        cases = (("free", None), ("json_schema", story))
        rates: dict[str, list[float]] = {name: [] for name, _ in cases}
        for _ in range(args.repeats):  # interleaved, so a busy moment of the machine hits both
            for name, grammar in cases:
                rates[name].append(decode_run(engine, slots, grammar, args.steps))
        for name, _ in cases:
            results[(slots, name, "tok/s")] = statistics.median(rates[name])
            print(f"{slots} slot(s), {name:11s}: as served {results[(slots, name, 'tok/s')]:6.1f} tok/s median "
                  f"(runs {', '.join(f'{r:.1f}' for r in rates[name])})")
        served = results[(slots, "free", "tok/s")] / results[(slots, "json_schema", "tok/s")]
        print(f"{slots} slot(s): as served, free tokens/s are {served:.2f}x the constrained ones")
    print(json.dumps({f"{s}x{n} {u}": round(v, 2) for (s, n, u), v in results.items()}))


if __name__ == "__main__":
    main()
