"""lm-evaluation-harness's loglikelihood path, through Strata and through transformers, on the same
model file (issue 29's battery bench): a multiple-choice task of --docs generated questions ("What
is the capital of ...?", four choices each), run by the real `lm-eval` package

- against a live `strata serve` (the default engine: the SmolLM2 GGUF in bf16 with int4 linears,
  its decode step compiled: the bench waits for the background build to end), through
  `local-completions` (echo + logprobs, its `remote` tokenizer on Strata's /tokenize),
  --concurrent requests in flight, --parallel slots;
- in process with lm-eval's `hf` model on the same GGUF (transformers dequantizes it to float32),
  --hf-batch rows a forward,

one after the other in one run. Prints each side's time for the task's requests (after start-up)
and loglikelihood requests per second, the ratio, both accuracies and the largest |delta|
between the two sides' loglikelihoods of the same (context, continuation) (Strata's step
precision against float32).

    .venv/bin/python -m bench.lm_eval_side_by_side [--docs 24] [--parallel 4] [--concurrent 4] [--hf-batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.files import default_model_path, served_model_name
from queues.server import free_port
from queues.settings import environ_without_settings

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
            ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"),
            ("Peru", "Lima"), ("Norway", "Oslo"), ("Greece", "Athens"), ("Cuba", "Havana"),
            ("Chile", "Santiago"), ("Poland", "Warsaw"), ("Russia", "Moscow"), ("China", "Beijing"),
            ("India", "New Delhi"), ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Sweden", "Stockholm"),
            ("Portugal", "Lisbon"), ("Hungary", "Budapest"), ("Finland", "Helsinki"), ("Thailand", "Bangkok")]

TASK = """task: bench_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def write_task(folder: Path, docs: int) -> None:
    lines = []
    for i in range(docs):
        country, capital = CAPITALS[i % len(CAPITALS)]
        others = [c for _, c in CAPITALS if c != capital]
        choices = [f" {c}" for c in (others[i % 7], capital, others[(i + 3) % 11], others[(i + 5) % 13])]
        lines.append(json.dumps({"country": country, "choices": choices, "answer": 1}))
    (folder / "capitals.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "bench_capitals.yaml").write_text(TASK.format(data=folder / "capitals.jsonl"))


def evaluate(folder: Path, model: object, model_args: str = "") -> tuple[dict, float]:
    """lm-eval on the task; the seconds its requests took (a model object is built beforehand)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    started = time.monotonic()
    results = simple_evaluate(model=model, model_args=model_args or None, tasks=["bench_capitals"],
                              task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                              random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return results, time.monotonic() - started


def requests_of(results: dict) -> list[tuple[tuple[str, str], float]]:
    """Every loglikelihood request lm-eval made: (context, continuation) and its answer."""
    return [(tuple(args), resp[0][0]) for sample in results["samples"]["bench_capitals"]
            for args, resp in zip(sample["arguments"], sample["resps"])]


def strata_side(folder: Path, args: argparse.Namespace) -> tuple[dict, float]:
    port, data = free_port(), Path(tempfile.mkdtemp(prefix="strata-lm-eval-"))
    serve = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(port), "--data-dir", str(data),
                              "--parallel", str(args.parallel), "--threads", "2", "--ctx", "1024"],
                             env=environ_without_settings(), stdout=subprocess.DEVNULL,
                             stderr=(data / "serve.log").open("w"))
    base, model = f"http://127.0.0.1:{port}", served_model_name(default_model_path())
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if model in [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=2).json()["data"]]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline or serve.poll() is not None:
                raise RuntimeError(f"strata serve did not come up; see {data / 'serve.log'}")
            time.sleep(0.5)
        # a fresh data folder builds the compiled decode step in a background child: measured
        # beside it, the requests would share the cores with a compiler
        while "decode_step" in httpx.get(f"{base}/health", timeout=10).json():
            if time.monotonic() > deadline + 1800:
                raise RuntimeError("the decode step was still compiling after 40 minutes")
            time.sleep(2)
        return evaluate(folder, "local-completions",
                        f"base_url={base}/v1/completions,model={model},tokenizer_backend=remote,"
                        f"num_concurrent={args.concurrent},max_retries=1,timeout=600")
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--hf-batch", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    folder = Path(tempfile.mkdtemp(prefix="bench-capitals-"))
    write_task(folder, args.docs)
    gguf = default_model_path()
    sides = {"strata": strata_side(folder, args)}
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(gguf.parent), gguf_file=gguf.name, dtype="float32", device="cpu",
              batch_size=args.hf_batch)  # loaded (dequantized) before the clock starts
    sides["transformers"] = evaluate(folder, hf)
    counts = {name: len(requests_of(results)) for name, (results, _s) in sides.items()}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    for name, (results, seconds) in sides.items():
        acc = results["results"]["bench_capitals"]["acc,none"]
        print(f"{name}: {counts[name]} loglikelihood requests in {seconds:.1f} s = {counts[name] / seconds:.1f}/s, "
              f"acc {acc:.3f} (load average {load})", flush=True)
    ours, theirs = dict(requests_of(sides["strata"][0])), dict(requests_of(sides["transformers"][0]))
    deltas = [abs(ours[k] - theirs[k]) for k in ours if k in theirs]
    rate = {name: counts[name] / seconds for name, (_r, seconds) in sides.items()}
    print(f"strata / transformers requests/s: {rate['strata'] / rate['transformers']:.2f}x; loglikelihood "
          f"max |delta| {max(deltas):.3f}, mean {sum(deltas) / len(deltas):.3f} over {len(deltas)} distinct requests "
          "(each side's requests only: strata serve was up, the hf model loaded, before its clock started)")


if __name__ == "__main__":
    main()
