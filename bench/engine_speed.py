"""Engine speed on the default SmolLM2 file: decode tok/s per batch size, prompt tok/s, time to
first token, load time and memory, for several engine variants in one run.

    .venv/bin/python -m bench.engine_speed [--variants default float32 ...] [--baseline REF]

A variant is `default` (what `strata serve` runs), `float32`, `bfloat16`, with `+noint4`
(bf16 linears dequantized instead of int4 from the file's blocks), `+noprefillbf16` (int4 only, no
bf16 copy for prefill chunks), `+eager` (no compiled decode step, `--no-compile`), `+gathered` (a
decode step gathers each row's K/V positions first instead of engine/attend.cpp reading the pool
in place), `+norepack` (a quantized file's Q4_K matrices as the file's blocks, `--no-repack`),
`+kv=NAME` (the KV pool in that `--kv-dtype`: float32, float16, bfloat16, int8) or `+nographs`
(on a GPU: the compiled step launched kernel by kernel, not replayed from CUDA graphs) or
`+isa=NAME` (that child under ONEDNN_MAX_CPU_ISA=NAME, e.g. AVX512_CORE_BF16: AMX off) or
`+quants=avx2` (that child on engine/quants' AVX2 build where the CPU has AVX-512 VNNI) or
`+model=PATH` (that child on another file: two files' speeds in one run) appended;
`+compile` asks for the compiled step from an engine that did not compile by default (a
`--baseline` before it did). `load s` includes the compile: inductor's cache is under the
temporary folder's strata-bench-cache (TORCHINDUCTOR_CACHE_DIR wins), so the first run after a
change pays the cold compile and later ones the warm.
`--baseline REF` adds the engine of a git commit (e.g. `main`) run from a temporary worktree, as
`REF:VARIANT` (`--baseline-variants`), so old and new are measured in the same run. Each variant
runs in its own process, so its memory is its own, and the variants are measured in turns, round
by round (median shown): the 2 cores are shared with whatever else runs, so compare ratios within
one run, not numbers across runs. `--device cuda:0` measures the GPU path (bf16, CUDA graphs).
`--model PATH` measures another file instead, e.g. a random one in a K-quant mix
(`.venv/bin/python -m bench.random_gguf --mix Q4_K_M` prints its path).
Prompt lookup (a one-row step checking a guessed token) is off here: this filler repeats itself, so
its guesses would nearly always be right; bench.side_by_side measures it on chat answers."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.baseline import checkout, env_with_first

DECODE_CONTEXT = 200
PREFILL_TOKENS = 2000
PREFILL_CHUNK = 512
TTFT_TOKENS = 100
CTX = 2048 + 64


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _load(variant: str, num_slots: int, threads: int | None, device: str = "cpu", model: str | None = None):
    """The engine for a variant, in the options of the engine found (a baseline's may be older: before
    int4 became the default it took `int4_decode`; before the prefill copy, no `prefill_bf16`)."""
    import inspect

    from engine.load import load_engine

    name, *flags = variant.split("+")
    dtype = None if name == "default" else name
    kwargs: dict = {}
    if "int4" not in inspect.signature(load_engine).parameters:
        kwargs["int4_decode"] = "int4" in flags
    else:
        kwargs["int4"] = "noint4" not in flags
        if "noprefillbf16" in flags:
            kwargs["prefill_bf16"] = False
        if "noint8prompt" in flags:  # bf16 slabs for a quantized file's prompt tokens (--no-prompt-int8)
            kwargs["prompt_int8"] = False
        if "norepack" in flags:  # Q4_K matrices as the file's blocks, not repacked (--no-repack)
            kwargs["repack"] = False
        kwargs["cache_dir"] = Path(tempfile.gettempdir()) / "strata-bench-cache"
        if "eager" in flags or "compile" in flags:
            kwargs["compile"] = "eager" not in flags
    for flag in flags:  # +kv=bfloat16, +kv=int8: the KV pool in that dtype (`strata serve --kv-dtype`)
        if flag.startswith("kv="):
            kwargs["kv_dtype"] = flag.removeprefix("kv=")
    if device != "cpu":  # a baseline older than --device has none
        kwargs["device"] = device
    if "gathered" in flags:  # the decode step gathers each row's positions first (engine/attend.cpp's fallback)
        import engine.layers

        engine.layers.IN_PLACE_DTYPES = ()
    engine = load_engine(model, num_slots=num_slots, ctx=CTX, dtype=dtype, threads=threads, **kwargs)
    if hasattr(engine, "use_prompt_lookup"):  # the step's own speed: what guesses give depends on the text
        engine.use_prompt_lookup(False)
    if "nographs" in flags and getattr(engine.compiled, "graphs", None) is not None:
        engine.compiled.graphs = None
    return engine


class Probe:
    """One variant's engine in its own process, measured on command (`serve_commands`) so the
    parent can interleave variants round by round: the shared cores' load then hits all of them
    alike, and the median of the rounds is compared."""

    def __init__(self, variant: str, num_slots: int, threads: int | None, device: str = "cpu",
                 model: str | None = None, context: int = DECODE_CONTEXT) -> None:
        from engine.protocol import SamplingParams

        self.rss_start = _status_mib("VmRSS")
        started = time.perf_counter()
        self.engine = _load(variant, num_slots, threads, device, model)
        self.load_s = time.perf_counter() - started
        self.rss_loaded = _status_mib("VmRSS")
        self.filler = self.engine.tokenizer.encode("The history of the lighthouse keepers of the northern coast. " * 400)
        self.greedy = SamplingParams(temperature=0.0)
        self.context = context

    def decode(self, num_slots: int, steps: int) -> float:
        engine, slots, last = self.engine, list(range(num_slots)), {}
        for s in slots:
            engine.begin(s, self.greedy)
            last[s] = engine.read(s, self.filler[s : s + self.context], sample=True)
        for _ in range(2):  # warm-up
            for s, t in zip(slots, engine.decode(slots, [last[s] for s in slots])):
                last[s] = t[-1] if isinstance(t, list) else t  # a list since decode may confirm guesses
        start = time.perf_counter()
        for _ in range(steps):
            for s, t in zip(slots, engine.decode(slots, [last[s] for s in slots])):
                last[s] = t[-1] if isinstance(t, list) else t
        return steps * num_slots / (time.perf_counter() - start)

    def prefill(self) -> float:
        engine, ids = self.engine, self.filler[:PREFILL_TOKENS]
        engine.begin(0, self.greedy)
        start = time.perf_counter()
        for i in range(0, len(ids), PREFILL_CHUNK):
            engine.read(0, ids[i : i + PREFILL_CHUNK], sample=i + PREFILL_CHUNK >= len(ids))
        return len(ids) / (time.perf_counter() - start)

    def ttft_ms(self) -> float:
        self.engine.begin(1, self.greedy)
        start = time.perf_counter()
        self.engine.read(1, self.filler[:TTFT_TOKENS], sample=True)
        return (time.perf_counter() - start) * 1000

    def stats(self) -> dict[str, float]:
        model = self.engine.model
        kv = model.kv_bytes() / 2**20 if hasattr(model, "kv_bytes") else float("nan")
        return {"load_s": self.load_s, "rss_start_mib": self.rss_start, "rss_loaded_mib": self.rss_loaded,
                "rss_peak_mib": _status_mib("VmHWM"), "kv_mib": kv}

    def serve_commands(self, steps: int) -> None:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            op, _, arg = line.strip().partition(" ")
            if op == "decode":
                value: object = self.decode(int(arg), steps)
            elif op == "prefill":
                value = self.prefill()
            elif op == "ttft":
                value = self.ttft_ms()
            elif op == "stats":
                value = self.stats()
            else:
                return
            print(json.dumps(value), flush=True)


class Child:
    def __init__(self, name: str, variant: str, args: argparse.Namespace, tree: Path | None) -> None:
        self.name = name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--variants", variant,
               "--steps", str(args.steps), "--slots", str(max(2, *args.batches)),  # ttft reads in slot 1
               "--context", str(args.context)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.device != "cpu":
            cmd += ["--device", args.device]
        model = next((f.removeprefix("model=") for f in variant.split("+")[1:] if f.startswith("model=")), args.model)
        if model:
            cmd += ["--model", model]
        root = tree or Path(__file__).resolve().parent.parent
        env = env_with_first(root)
        for flag in variant.split("+")[1:]:
            if flag.startswith("isa="):  # oneDNN reads it once, at its first use: set for the child
                env["ONEDNN_MAX_CPU_ISA"] = flag.removeprefix("isa=")
            if flag.startswith("quants="):  # engine/quants' build, read once likewise
                env["STRATA_QUANTS_ISA"] = flag.removeprefix("quants=")
        self.process = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ask_line()  # ready: loaded

    def ask_line(self, command: str | None = None) -> object:
        assert self.process.stdin is not None and self.process.stdout is not None
        if command is not None:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited")
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue  # a library's stray print

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["default", "default+eager", "float32"])
    parser.add_argument("--baseline", default=None, help="a git ref whose engine runs too (e.g. main)")
    parser.add_argument("--baseline-variants", nargs="+", default=["float32", "bfloat16+int4"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per sample")
    parser.add_argument("--context", type=int, default=DECODE_CONTEXT, help="tokens each decoding slot holds")
    parser.add_argument("--rounds", type=int, default=3, help="samples per measurement; the median is shown")
    parser.add_argument("--slots", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:N for the GPU path")
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder instead of the default SmolLM2 "
                        "(e.g. bench.random_gguf's; its tokenizer must encode text)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        Probe(args.variants[0], args.slots, args.threads, args.device, args.model, args.context).serve_commands(args.steps)
        return

    from rich.console import Console
    from rich.table import Table

    children: list[Child] = []
    with checkout(args.baseline) as worktree:
        try:
            for variant in args.baseline_variants if worktree else []:
                children.append(Child(f"{args.baseline}:{variant}", variant, args, worktree))
            for variant in args.variants:
                children.append(Child(variant, variant, args, None))
            samples: dict[str, dict[str, list[float]]] = {c.name: {} for c in children}
            commands = [(f"decode_b{b}", f"decode {b}") for b in args.batches] + [("prefill", "prefill"), ("ttft_ms", "ttft")]
            for round_ in range(args.rounds):
                for key, command in commands:
                    for child in children if round_ % 2 == 0 else children[::-1]:
                        samples[child.name].setdefault(key, []).append(float(child.ask_line(command)))  # type: ignore[arg-type]
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
            runs = []
            for child in children:
                result = {key: statistics.median(values) for key, values in samples[child.name].items()}
                result.update(child.ask_line("stats"))  # type: ignore[arg-type]
                runs.append((child.name, result))
                print(child.name, json.dumps(result), file=sys.stderr, flush=True)
        finally:
            for child in children:
                child.close()

    base_name, base = runs[0]
    table = Table(title=f"{args.model or 'SmolLM2-135M-Instruct Q4_1'}, decode at ~{args.context} tokens of context; median of "
                        f"{args.rounds} interleaved rounds; (×) = ratio to {base_name}, same run")
    table.add_column("variant", no_wrap=True)
    columns = [(f"decode_b{b}", f"decode B={b} tok/s") for b in args.batches]
    columns += [("prefill", f"prompt tok/s ({PREFILL_TOKENS} in {PREFILL_CHUNK}s)"),
                ("ttft_ms", f"TTFT {TTFT_TOKENS} tok ms"), ("load_s", "load s"),
                ("rss_loaded_mib", "RSS loaded MiB"), ("rss_peak_mib", "RSS peak MiB"), ("kv_mib", "KV MiB")]
    for _, title in columns:
        table.add_column(title, justify="right")
    for name, result in runs:
        cells = []
        for key, _ in columns:
            value = result[key]
            text = f"{value:.2f}" if key == "load_s" else f"{value:.0f}"
            if key.startswith("decode") or key == "prefill":
                text += f" ({value / base[key]:.2f}×)"
            cells.append(text)
        table.add_row(name, *cells)
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
