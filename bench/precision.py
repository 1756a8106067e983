"""How close greedy decoding stays to the float32 dequantized reference: Strata's default engine
and, when `LLAMA_SERVER=/path/to/llama-server` is set, llama.cpp's server on the same GGUF.

    .venv/bin/python -m bench.precision [--tokens 48] [--variants default bfloat16+noint4] [--device cuda:0] [--model F]
    .venv/bin/python -m bench.precision --isa all [--prompts 4]    # each oneDNN ISA this CPU offers
    .venv/bin/python -m bench.precision --variants float32+kv=bfloat16 float32+kv=int8 default+kv=int8
    LLAMA_SERVER=/path/to/llama-server .venv/bin/python -m bench.precision

`+eager`: no compiled step (nothing to build); `+norepack`: Q4_K matrices as the file's blocks;
`+noint8prompt`: bf16 slabs for a quantized file's
prompt tokens where they would be int8 (`--no-prompt-int8`); `+kv=NAME` gives a variant that `--kv-dtype` (bfloat16, int8; fp8 on CUDA): on `float32` the cost of
the narrower cache alone. `--isa AVX512_CORE_BF16 AVX512_CORE_AMX ...` (or `all`) runs the whole bench once per value of
ONEDNN_MAX_CPU_ISA, each in a child process (oneDNN reads it once), and prints one row per ISA
and engine: its bf16 kernels round differently on AMX, AVX512-BF16 and AVX512.

A fixed set of chat prompts, tokenized once by Strata's tokenizer; every engine gets the same
token ids (llama-server through `/completion` with a token-id prompt, `temperature` 0). The
reference is Strata with `--dtype float32`, eager (`--no-compile`: nothing to build; the default
scored the same against the compiled reference, docs/bench-log.md "On a GPU"): the file's weights
dequantized, no rounding beyond float32, on the CPU also when `--device` puts the variants on a
GPU. Two measures per engine, summed over the prompts:
- teacher-forced: at each position of the reference's greedy continuation, fed the reference's
  tokens so far, is the engine's greedy next token the reference's? (llama-server: one
  `n_predict: 1` request per position; its prompt cache reads only the new token);
- free-running: the engine's own greedy continuation, tokens equal to the reference's before the
  first difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import httpx

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "What is 17 times 23?",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of copper.",
    "Write a Python function that reverses a string.",
    "What is the boiling point of water at sea level?",
    "Give me a tip for sleeping better.",
    "Summarize the plot of Cinderella in one paragraph.",
    "Why do cats purr?",
]


def strata_greedy(engine, ids: list[int], tokens: int) -> list[int]:
    """Greedy continuation, never stopping at end-of-text (every engine runs the same length)."""
    from bench.prompt_lookup import generate
    from engine.protocol import SamplingParams

    return generate(engine, ids, tokens, SamplingParams(temperature=0.0))[0]


def strata_forced(engine, ids: list[int], reference: list[int]) -> list[int]:
    """The engine's greedy next token after the prompt and after each reference token but the last."""
    from engine.protocol import SamplingParams

    lookup = engine.prompt_lookup
    engine.use_prompt_lookup(False)  # one token a step: each step is fed the reference's
    engine.begin(0, SamplingParams(temperature=0.0))
    out = [engine.read(0, ids, sample=True)]
    for token in reference[:-1]:
        out += engine.decode([0], [token])[0]
    engine.use_prompt_lookup(lookup)
    return out


class LlamaServer:
    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=300)

    def _complete(self, ids: list[int], n: int) -> list[int]:
        body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": True, "return_tokens": True, "samplers": ["top_k"]}
        response = self.client.post("/completion", json=body)
        response.raise_for_status()
        return response.json()["tokens"]

    def greedy(self, ids: list[int], tokens: int) -> list[int]:
        return self._complete(ids, tokens)

    def forced(self, ids: list[int], reference: list[int]) -> list[int]:
        return [self._complete(ids + reference[:i], 1)[0] for i in range(len(reference))]


def run_prompts(greedy, forced, prompts: list[list[int]], references: list[list[int]]) -> dict[str, int]:
    same_top = prefix = 0
    for ids, reference in zip(prompts, references):
        same_top += sum(a == b for a, b in zip(forced(ids, reference), reference))
        own = greedy(ids, len(reference))
        prefix += next((i for i, (a, b) in enumerate(zip(own, reference)) if a != b), len(reference))
    return {"same_top": same_top, "greedy_prefix": prefix}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48, help="continuation length per prompt")
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    parser.add_argument("--variants", nargs="+", default=["default", "bfloat16+noint4"],
                        help="Strata engines: default, float32, bfloat16(+noint4), each +kv=DTYPE")
    parser.add_argument("--device", default="cpu", help="where the variants run: cpu, or cuda:N")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N prompts only (short runs)")
    parser.add_argument("--isa", nargs="+", default=[],
                        help="ONEDNN_MAX_CPU_ISA values to run under, one child process each, or 'all'")
    args = parser.parse_args()
    if args.isa:
        per_isa(args)
        return

    from bench.side_by_side import llama_server
    from engine.files import resolve_model_path
    from engine.load import load_engine

    path = resolve_model_path(args.model)
    reference_engine = load_engine(path, num_slots=1, ctx=1024, dtype="float32", compile=False)
    tok = reference_engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    references = [strata_greedy(reference_engine, ids, args.tokens) for ids in prompts]
    total = sum(len(r) for r in references)
    del reference_engine
    results: dict[str, dict[str, int]] = {}
    for variant in args.variants:
        name, *flags = variant.split("+")
        # two slots: the free-running answers go through prompt lookup as served (one slot has none)
        kv = next((f.removeprefix("kv=") for f in flags if f.startswith("kv=")), None)  # +kv=int8: --kv-dtype
        engine = load_engine(path, num_slots=2, ctx=1024, dtype=None if name == "default" else name,
                             int4="noint4" not in flags, prompt_int8="noint8prompt" not in flags,
                             repack="norepack" not in flags,
                             device=args.device, kv_dtype=kv,
                             compile="eager" not in flags)
        results[f"strata {variant}"] = run_prompts(lambda i, n: strata_greedy(engine, i, n),
                                                   lambda i, r: strata_forced(engine, i, r), prompts, references)
        print(variant, json.dumps(results[f"strata {variant}"]), file=sys.stderr, flush=True)
    binary = os.environ.get("LLAMA_SERVER")
    if binary:
        with llama_server(binary, path, 1, 1024) as server:
            llama = LlamaServer(server.url)
            results["llama-server"] = run_prompts(llama.greedy, llama.forced, prompts, references)

    from rich.console import Console
    from rich.table import Table

    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    table = Table(title=f"{len(prompts)} chat prompts x {args.tokens} greedy tokens vs the float32 dequantized "
                        f"reference ({path.name}; variants on {args.device}{'; ONEDNN_MAX_CPU_ISA=' + isa if isa else ''})")
    table.add_column("engine")
    table.add_column("teacher-forced: same next token", justify="right")
    table.add_column("free-running: equal before the first difference", justify="right")
    for name, r in results.items():
        table.add_row(name, f"{r['same_top']}/{total} ({r['same_top'] / total:.1%})",
                      f"{r['greedy_prefix']}/{total} ({r['greedy_prefix'] / total:.1%})")
    Console(width=160).print(table)
    print(json.dumps({"total": total, "isa": isa, **results}))


def per_isa(args: argparse.Namespace) -> None:
    """The bench again in a child process per ONEDNN_MAX_CPU_ISA value; one table of them all."""
    from rich.console import Console
    from rich.table import Table

    from engine.devices import onednn_isas

    isas = onednn_isas() if args.isa == ["all"] else args.isa
    argv = [sys.executable, "-m", "bench.precision", "--tokens", str(args.tokens), "--prompts", str(args.prompts),
            *(["--model", args.model] if args.model else []),
            "--device", args.device, "--variants", *args.variants]
    table = Table(title=f"{args.prompts} chat prompts x {args.tokens} greedy tokens vs the float32 reference, per ISA")
    for column in ("ONEDNN_MAX_CPU_ISA", "engine", "teacher-forced", "free-running"):
        table.add_column(column)
    for isa in isas:
        done = subprocess.run(argv, env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa}, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{isa}: {done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        total = result.pop("total")
        result.pop("isa")
        for name, r in result.items():
            table.add_row(isa, name, f"{r['same_top']}/{total}", f"{r['greedy_prefix']}/{total}")
        print(isa, json.dumps(result), file=sys.stderr, flush=True)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
