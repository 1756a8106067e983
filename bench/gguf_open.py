"""Opening a GGUF on a fresh data folder, ours against the readers it replaced, in one run (issue 24):
gguf's GGUFReader vs engine.gguf_file.GGUFFile (no index cache), and AutoTokenizer(gguf_file=...)
vs the tokenizer conversion engine/tokenizer.py does, each `--rounds` times, median seconds.

    .venv/bin/python -m bench.gguf_open [--model PATH] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import engine  # noqa: F401 - first: OpenMP's wait policy before torch loads (engine/__init__.py)


def _median_s(run, rounds: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from engine.files import resolve_model_path
    from engine.gguf_file import GGUFFile
    from engine.tokenizer import _gguf_tokenizer

    path = resolve_model_path(args.model)
    GGUFFile(path)  # imports and page cache warm for both sides
    result = {
        "GGUFReader s": _median_s(lambda: GGUFReader(path), args.rounds),
        "GGUFFile s": _median_s(lambda: GGUFFile(path), args.rounds),
        "AutoTokenizer(gguf_file) s": _median_s(
            lambda: AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True), args.rounds),
        "our conversion s": _median_s(lambda: _gguf_tokenizer(path, None), args.rounds),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
