"""Strata and llama.cpp's server on the same GGUF, through HTTP, with the same streaming client.

    .venv/bin/python -m bench.side_by_side [--model FILE] [--parallel 8] [-- extra strata serve flags]
    LLAMA_SERVER=/path/to/llama-server .venv/bin/python -m bench.side_by_side

Each server is started in turn (never both at once: they share the cores), then:
- decode: 1, 2, 4, 8 concurrent streaming chat clients, `ignore_eos`, 128 tokens each; total
  completion tokens / wall time;
- prompt: one ~2000-token prompt with max_tokens=1; prompt tokens / time to the first token;
- deep (not by default): one request after a ~4 000-token prompt (`--deep-words`), its decode
  rate from its first token on: decode where attention over a long context is most of a step
  (an agent's turn); llama-server started with slots of 8 192 tokens for it;
- alert during a battery (docs/design.md): 4 slots busy with 300-token answers and 8 more queued at a
  low priority; a short request at a high priority 2 s later; its time to first token (llama.cpp
  ignores `priority`: plain FIFO, which is what it offers).
Prints one table with Strata / llama.cpp ratios. Without LLAMA_SERVER only Strata runs.
Strata is measured on its default, the compiled step: on a fresh data folder it serves eagerly
while that builds in the background, and the bench waits until /health says it is in.
Requests are greedy (`temperature` 0) unless `--temperature` / `--top-p` say otherwise: then each
server samples as it does for its users (llama.cpp's own chain adds top_k 40 and min_p 0.05).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.baseline import checkout, env_with_first
from queues.server import free_port

TOKENS = 128
BATTERY_TOKENS = 300
SCENARIO_SLOTS = 4
DEEP_CONTEXT = 8192  # llama-server: tokens a slot holds in the deep stage (its -c is the slots times this)


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    ready_path: str
    env: dict[str, str] | None = None
    cwd: Path | None = None  # `python -m` puts its working directory first on the path
    model: str = ""
    start_s: float = 0.0
    compiled_s: float = 0.0  # Strata: until its compiled step took over from the eager one
    process: subprocess.Popen | None = None
    log: Path = field(default_factory=lambda: Path(tempfile.mkstemp(suffix=".log")[1]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        self.process = subprocess.Popen(self.argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                        start_new_session=True, env=self.env, cwd=self.cwd)
        try:
            return self._wait_ready()
        except BaseException:  # not ready, a timeout, a SIGTERM: `with` will not call __exit__
            self.__exit__()
            raise

    def _wait_ready(self) -> "Server":
        started = time.monotonic()
        while time.monotonic() - started < 600:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log}")
            try:
                response = httpx.get(self.url + self.ready_path, timeout=2)
                if response.status_code == 200 and (self.ready_path != "/v1/models" or response.json().get("data")):
                    data = httpx.get(self.url + "/v1/models", timeout=2).json().get("data") or [{}]
                    self.model = data[0].get("id", "")
                    self.start_s = time.monotonic() - started
                    self._wait_compiled(started)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not become ready; see {self.log}")

    def _wait_compiled(self, started: float) -> None:
        """Strata serves eagerly at once on a fresh data folder while its compiled step builds in
        the background (engine/background.py); its default is the compiled step, so measure that:
        wait while /health says a worker is still building it."""
        if self.ready_path != "/v1/models":
            return
        said = ""
        while time.monotonic() - started < 3600:
            building = httpx.get(self.url + "/health", timeout=5).json().get("decode_step")
            if not building:  # compiled_s only where a build was seen (an eager-only model has none)
                self.compiled_s = time.monotonic() - started if said else 0.0
                return
            if str(building) != said:
                said = str(building)
                print(f"  {self.name}: {said}", flush=True)
            time.sleep(5)
        raise TimeoutError(f"{self.name}'s compiled step did not finish building; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)


SAMPLING: dict[str, float] = {"temperature": 0}  # every request's; --temperature / --top-p change it


async def chat(client: httpx.AsyncClient, server: Server, content: str, max_tokens: int,
               priority: int | None = None) -> dict[str, float]:
    """One streaming request: time to first token, completion and prompt tokens (from usage)."""
    body: dict = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                  "stream": True, "ignore_eos": True, **SAMPLING, "stream_options": {"include_usage": True}}
    if priority is not None:
        body["priority"] = priority
    sent = time.monotonic()
    first = None
    chunks = 0
    usage: dict = {}
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = time.monotonic()
    done = time.monotonic()
    return {"sent": sent, "ttft_s": (first or done) - sent, "done": done,
            "completion_tokens": usage.get("completion_tokens", chunks), "prompt_tokens": usage.get("prompt_tokens", 0)}


def words(seed: int, count: int) -> str:
    """Distinct filler text per request (no shared prefix for a conversation cache to reuse)."""
    vocab = ["harbour", "lantern", "granite", "tide", "keeper", "signal", "northern", "storm", "beacon", "gull",
             "rope", "ledger", "island", "fog", "engine", "winter", "copper", "anchor", "channel", "reef"]
    return " ".join(vocab[(seed * 7 + i * (seed % 5 + 3)) % len(vocab)] + str((seed + i) % 97) for i in range(count))


async def decode_rate(server: Server, clients: int, round_: int, cpu: dict[str, float] | None = None) -> float:
    """Total completion tokens / wall time. `cpu`: adds each process's CPU ms per token (the
    server's processes by name, and this client) over the run."""
    async with httpx.AsyncClient() as client:
        before = cpu_seconds(server.process.pid) if cpu is not None else {}
        started = time.monotonic()
        results = await asyncio.gather(*(
            chat(client, server, f"Story {round_}-{i}: " + words(100 * round_ + i, 20), TOKENS) for i in range(clients)))
        wall = time.monotonic() - started
        tokens = sum(r["completion_tokens"] for r in results)
        if cpu is not None:
            after = cpu_seconds(server.process.pid)
            for name, seconds in after.items():
                cpu[name] = cpu.get(name, 0.0) + 1000 * (seconds - before.get(name, 0.0)) / tokens
            cpu["wall"] = cpu.get("wall", 0.0) + 1000 * wall / tokens
        return tokens / wall


def cpu_seconds(root: int) -> dict[str, float]:
    """User + system CPU seconds of `root` and its descendants by process name (the second word
    of a `python -m strata api` command line, else the program's name), and of this process
    ("client"). Tick resolution (10 ms a process): meant for runs of seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    out: dict[str, float] = {}
    for pid in [*tree, os.getpid()]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if pid == os.getpid():
            name = "client"
        elif b"strata" in argv and argv.index(b"strata") + 1 < len(argv):
            name = argv[argv.index(b"strata") + 1].decode()
        else:
            name = Path(argv[0].decode().split()[0]).name  # redis-server retitles itself "redis-server host:port"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


async def prompt_rate(server: Server, prompt_words: int) -> float:
    """The better of two prompts' rates; of one where the server went away after the first
    (llama-server exits after a long prompt on the random-weight files: "cleaning up before exit"
    in its log, no request of ours asks it to)."""
    best = 0.0
    async with httpx.AsyncClient() as client:
        for attempt in range(2):
            try:
                r = await chat(client, server, words(1000 + attempt, prompt_words), 1)
            except httpx.HTTPError as e:
                if not best:
                    raise
                print(f"  {server.name}: second prompt failed ({e!r}); its first prompt's rate stands", flush=True)
                break
            best = max(best, r["prompt_tokens"] / r["ttft_s"])
    return best


async def deep_decode_rate(server: Server, prompt_words: int) -> dict[str, float]:
    """One request after a long prompt: its decode rate from the first token on (the prompt's
    read left out), and that prompt's length in tokens."""
    async with httpx.AsyncClient() as client:
        r = await chat(client, server, words(2000, prompt_words), TOKENS)
    after_first = r["done"] - r["sent"] - r["ttft_s"]
    return {"deep": (r["completion_tokens"] - 1) / after_first, "deep_prompt": r["prompt_tokens"]}


async def alert_during_battery(server: Server) -> float:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        battery = [asyncio.create_task(chat(client, server, f"Battery {i}: " + words(500 + i, 12), BATTERY_TOKENS, -5))
                   for i in range(3 * SCENARIO_SLOTS)]
        await asyncio.sleep(2.0)
        alert = await chat(client, server, "Alert: disk full on host 7. Summarize in one line.", 8, 10)
        await asyncio.gather(*battery)
        return alert["ttft_s"]


def strata_server(args: argparse.Namespace, parallel: int, extra: list[str], tree: Path | None = None,
                  name: str = "strata") -> Server:
    """`strata serve` in a fresh data folder (its embedded Redis keeps queues across restarts: a
    run killed midway must not leave requests for the next one), sharing one tokenizer cache.
    `tree`: another checkout whose packages come first (--baseline)."""
    port = free_port()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="run-", dir=args.data_dir))
    (args.data_dir / "cache").mkdir(exist_ok=True)
    (data / "cache").symlink_to(args.data_dir / "cache")
    argv = [sys.executable, "-m", "strata", "serve", "--port", str(port), "--parallel", str(parallel),
            "--data-dir", str(data)]
    if args.model:
        argv += ["--model", args.model]
    env = env_with_first(tree) if tree else None
    return Server(name, argv + extra, port, "/v1/models", env, tree)


def llama_server(binary: str, model: str | Path | None, parallel: int, ctx_per_slot: int = 2048) -> Server:
    """llama.cpp's server as a user runs it: its defaults, `-np` slots of `ctx_per_slot` each."""
    from engine.files import resolve_model_path

    port = free_port()
    argv = [binary, "-m", str(resolve_model_path(model)), "--port", str(port), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "--host", "127.0.0.1"]
    return Server("llama.cpp", argv, port, "/health")


def measure(make, args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    if {"decode", "prompt"} & set(args.stages):
        with make(args.parallel) as server:
            out["start_s"] = server.start_s
            if server.compiled_s:
                out["compiled_s"] = server.compiled_s
            asyncio.run(decode_rate(server, 1, 0))  # warm-up
            if "decode" in args.stages:
                for clients in args.clients:
                    cpu: dict[str, float] = {}
                    rates = [asyncio.run(decode_rate(server, clients, r + 1, cpu)) for r in range(args.rounds)]
                    out[f"clients_{clients}"] = statistics.median(rates)
                    for name, ms in cpu.items():  # summed over the rounds: their mean
                        out[f"cpu_{clients}_{name}"] = ms / args.rounds
            if "prompt" in args.stages:
                out["prompt"] = asyncio.run(prompt_rate(server, args.prompt_words))
    if "deep" in args.stages:  # a server whose every slot can hold the long prompt
        with make(args.parallel, DEEP_CONTEXT) as server:
            asyncio.run(decode_rate(server, 1, 0))
            out.update(asyncio.run(deep_decode_rate(server, args.deep_words)))
    if "alert" in args.stages:
        with make(SCENARIO_SLOTS) as server:
            asyncio.run(decode_rate(server, 1, 0))
            out["alert_ttft_s"] = asyncio.run(alert_during_battery(server))
    return out


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3, help="runs per client count (median)")
    parser.add_argument("--prompt-words", type=int, default=680, help="~3 tokens a word with this filler (SmolLM2)")
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-side-by-side")
    parser.add_argument("--stages", nargs="+", default=["decode", "prompt", "alert"],
                        choices=["decode", "prompt", "deep", "alert"])
    parser.add_argument("--deep-words", type=int, default=1300,
                        help="the deep stage's prompt (~3 tokens a word: ~4 000 tokens)")
    parser.add_argument("--repeats", type=int, default=1, help="whole runs of every server, alternating which goes first")
    parser.add_argument("--servers", nargs="+", choices=["strata", "llama.cpp"], default=["strata", "llama.cpp"],
                        help="which to run (llama.cpp needs LLAMA_SERVER)")
    parser.add_argument("--start-with", choices=["strata", "llama.cpp"], default="strata")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="every request's (unset: the server's default)")
    parser.add_argument("--baseline", default=None, metavar="REF",
                        help="also run `strata serve` of this git ref (e.g. main) from a temporary worktree, as strata@REF")
    parser.add_argument("strata_args", nargs="*", help="extra `strata serve` flags (after --)")
    args = parser.parse_args()
    SAMPLING["temperature"] = args.temperature
    if args.top_p is not None:
        SAMPLING["top_p"] = args.top_p

    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the servers' `with` blocks stop them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    makers = {"strata": lambda n, _ctx=None: strata_server(args, n, args.strata_args)} if "strata" in args.servers else {}
    binary = os.environ.get("LLAMA_SERVER")
    if binary and "llama.cpp" in args.servers:
        makers["llama.cpp"] = lambda n, ctx=2048: llama_server(binary, args.model, n, ctx)
    with checkout(args.baseline) as worktree:
        if worktree is not None:
            baseline = f"strata@{args.baseline}"
            makers[baseline] = lambda n, _ctx=None: strata_server(args, n, args.strata_args, worktree, baseline)
        results, loads = run_all(makers, args)
    report(results, loads, args)


def run_all(makers: dict, args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], list[str]]:
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in makers}
    loads = [load_average()]
    for repeat in range(args.repeats):
        # alternate which server goes first, so a change in the machine's load hits both alike
        order = list(makers) if args.start_with == "strata" else list(makers)[::-1]
        for name in (order if repeat % 2 == 0 else order[::-1]):
            result = measure(makers[name], args)
            loads.append(load_average())
            print(name, json.dumps(result), "load", loads[-1], flush=True)
            for key, value in result.items():
                samples[name].setdefault(key, []).append(value)
    results = {name: {k: statistics.median(v) for k, v in got.items()} for name, got in samples.items()}
    return results, loads


def report(results: dict[str, dict[str, float]], loads: list[str], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    others = [name for name in results if name != "strata"] if "strata" in results else []
    table = Table(title=f"Same GGUF, same streaming client, one server after the other; median of {args.repeats} "
                        f"run(s) x {args.rounds} round(s); sampling {SAMPLING}; load average {' -> '.join(loads)}")
    table.add_column("measure")
    for name in results:
        table.add_column(name, justify="right")
    for other in others:
        table.add_column(f"strata / {other}", justify="right")
    rows = [(f"clients_{c}", f"decode tok/s, {c} client{'s' if c > 1 else ''}") for c in args.clients]
    rows += [("prompt", "prompt tok/s (one ~2000-token prompt)"),
             ("deep", "decode tok/s after a long prompt, 1 client"), ("deep_prompt", "  that prompt, tokens"),
             ("alert_ttft_s", "alert during a battery: TTFT s"),
             ("start_s", "start until ready, s")]
    for key, title in rows:
        if not all(key in r for r in results.values()):
            continue
        cells = [f"{r[key]:.1f}" for r in results.values()]
        cells += [f"{results['strata'][key] / results[other][key]:.2f}×" for other in others]
        table.add_row(title, *cells)
    Console(width=160).print(table)
    if "compiled_s" in results.get("strata", {}):
        print(f"strata: measured on its compiled step, in {results['strata']['compiled_s']:.0f} s after start")
    for name, r in results.items():
        cpu_table(name, r, args.clients)


def cpu_table(server: str, result: dict[str, float], clients: list[int]) -> None:
    """Per completion token: wall ms and each process's CPU ms (2 cores: the sum can reach twice the wall)."""
    from rich.console import Console
    from rich.table import Table

    names = sorted({k.split("_", 2)[2] for k in result if k.startswith("cpu_")} - {"wall"})
    if not names:
        return
    table = Table(title=f"{server}: ms per completion token, wall and CPU by process (decode stage)")
    for column in ("clients", "wall", *names, "CPU total"):
        table.add_column(column, justify="right")
    for c in clients:
        cells = [result.get(f"cpu_{c}_{name}", 0.0) for name in names]
        table.add_row(str(c), f"{result.get(f'cpu_{c}_wall', 0.0):.2f}", *(f"{ms:.2f}" for ms in cells),
                      f"{sum(cells):.2f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
