"""Log-probabilities: how close the default engine's are to the float32 engine's, and what
asking for them costs a decode step.

    .venv/bin/python -m bench.logprobs --precision [--tokens 32] [--prompts 12]
    .venv/bin/python -m bench.logprobs --speed [--steps 48] [--rounds 3] [--compiled]

--precision: for bench.precision's chat prompts, the default engine (bf16 activations, int4
linears, the file's Q8_0 head rows times the float32 residual) decodes greedily with logprobs; each sampled token's
logprob is compared with log_softmax of the float32 engine's logits at the same position, fed the
same tokens (teacher-forced), and so are the prompt's own tokens (echo scoring, read in chunks
of 64). Prints max and mean |delta| for both, and the largest error in the normaliser and the
top-20 logprobs the head reports (the default file's Q8_0 rows times the float32 residual)
against the file's rows times the same residual in float64.
--speed: decode tokens/s with logprobs off and on (top 5), alternating --rounds times, at 1 and 8
slots, one run: each pair's ratio and their median. Eager, or with --compiled the default step
(the packages compiled ahead of time, built first if not cached).
"""

from __future__ import annotations

import argparse
import time

import torch


def _default(compiled: bool = False):
    from engine import load_engine

    return load_engine(None, num_slots=8, ctx=1024, threads=2, compile=compiled, prompt_lookup=False)


def _engines():
    from engine import load_engine

    reference = load_engine(None, num_slots=1, ctx=1024, dtype="float32", threads=2, compile=False,
                            prompt_lookup=False)
    return _default(), reference


def _reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    from engine.model import CacheIndex

    index = CacheIndex.for_slots([0], torch.arange(len(ids)).unsqueeze(0), len(ids))
    with torch.inference_mode():
        return torch.log_softmax(reference.model.logits(reference.model.forward_all(torch.tensor([ids]), index)[0]), -1)


def precision(tokens: int, prompts: int) -> None:
    from bench.precision import PROMPTS
    from engine.protocol import SamplingParams

    default, reference = _engines()
    tok = default.tokenizer
    answer_deltas, prompt_deltas = [], []
    for text in PROMPTS[:prompts]:
        ids = tok.encode_chat([{"role": "user", "content": text}])
        default.begin(0, SamplingParams(temperature=0.0, logprobs=0, prompt_logprobs=0))
        for lo in range(0, len(ids), 64):
            token = default.read(0, ids[lo:lo + 64], sample=lo + 64 >= len(ids))
        prompt_scores = default.prompt_logprobs(0)
        out = [token]
        while len(out) < tokens:
            out += default.decode([0], [out[-1]])[0]
        scores = default.logprobs(0)
        expected = _reference_logprobs(reference, ids + out)
        prompt_deltas += [abs(s.logprob - float(expected[i, s.token])) for i, s in enumerate(prompt_scores)]
        answer_deltas += [abs(s.logprob - float(expected[len(ids) - 1 + i, s.token])) for i, s in enumerate(scores)]
        print(f"{text[:40]!r}: answer max |delta| so far {max(answer_deltas):.4f}, prompt {max(prompt_deltas):.4f}",
              flush=True)
    for name, deltas in (("answer (greedy)", answer_deltas), ("prompt (echo)", prompt_deltas)):
        print(f"{name:16s} tokens {len(deltas):5d}  max |delta| {max(deltas):.4f}  mean {sum(deltas) / len(deltas):.4f}")
    head_normaliser(default, reference, [tok.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS[:prompts]])


def head_normaliser(default, reference, prompts: list[list[int]]) -> None:
    """The head's share alone: the default engine's own residuals h and the logits a row that asks
    for logprobs reports (a GGUF file's quantized head: its blocks times h in float32, what every
    row samples from too; an int8 head: every logit of a scored row recomputed) against h times
    the file's rows in float64. The difference of their log-sum-exp is the normaliser's error;
    the top-20 logprobs' too."""
    from engine.model import CacheIndex

    exact_rows = reference.model.head.weight  # float32 [V, dim]: the file's rows dequantized
    lse_worst = top_worst = 0.0
    rows = 0
    for ids in prompts:
        index = CacheIndex.for_slots([0], torch.arange(len(ids)).unsqueeze(0), len(ids))
        with torch.inference_mode():
            h = default.model.forward_all(torch.tensor([ids]), index)[0]
            exact = h.double() @ exact_rows.double().t()
            # [2B, V] (sampled, reported) for a low-precision head, [B, V] for an exact one
            reported = default.model.logits(h.clone(), scored=torch.ones(len(ids), dtype=torch.bool))[-len(ids):]
        reported = reported.double()
        top = torch.topk(exact, 20, dim=-1).indices
        lse_worst = max(lse_worst, float((torch.logsumexp(reported, -1) - torch.logsumexp(exact, -1)).abs().max()))
        delta = (torch.log_softmax(reported, -1).gather(1, top) - torch.log_softmax(exact, -1).gather(1, top)).abs()
        top_worst = max(top_worst, float(delta.max()))
        rows += len(ids)
    print(f"reported logits ({type(default.model.head).__name__} head), {rows} positions: normaliser max |delta| "
          f"{lse_worst:.2e}, top-20 logprobs max |delta| {top_worst:.2e}")


def speed(steps: int, rounds: int, compiled: bool) -> None:
    """Off and on alternate, `rounds` times each, in one run: a load that drifts (the cores are
    shared) touches both alike; the ratio of each pair and their median are printed."""
    import statistics

    from engine.protocol import SamplingParams

    default = _default(compiled)  # no float32 reference: speed needs none
    prompt = default.tokenizer.encode("The history of the city begins")

    def rate(rows: int, logprobs: int | None) -> float:
        for slot in range(rows):
            default.begin(slot, SamplingParams(temperature=0.0, logprobs=logprobs))
            default.read(slot, prompt, sample=True)
        last = [1] * rows
        started = time.perf_counter()
        for _ in range(steps):
            last = [t[-1] for t in default.decode(list(range(rows)), last)]
            for slot in range(rows):
                default.logprobs(slot)
        return rows * steps / (time.perf_counter() - started)

    rate(1, None)  # warm: the first steps pay one-time costs
    for rows in (1, 8):
        pairs = [(rate(rows, None), rate(rows, 5)) for _ in range(rounds)]
        ratios = [off / on for off, on in pairs]
        shown = ", ".join(f"{off:.1f}/{on:.1f}" for off, on in pairs)
        print(f"{'compiled' if compiled else 'eager'}, {rows} slots, {steps} steps x {rounds} rounds: tok/s off/on {shown}; off/on each "
              f"{', '.join(f'{r:.3f}' for r in ratios)}, median {statistics.median(ratios):.3f}x "
              f"(load average {', '.join(f'{x:.1f}' for x in __import__('os').getloadavg())})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=12, help="how many of bench.precision's prompts")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="--speed: off/on pairs, alternating")
    parser.add_argument("--compiled", action="store_true", help="--speed: the default step, not eager")
    args = parser.parse_args()
    if args.precision:
        precision(args.tokens, args.prompts)
    if args.speed:
        speed(args.steps, args.rounds, args.compiled)


if __name__ == "__main__":
    main()
