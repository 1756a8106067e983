"""A random-weight GGUF of a real model's shape in one of llama.cpp's mixes, carrying the default
model's tokenizer and chat template (SmolLM2's vocabulary of 49 152 is SmolLM2-1.7B's too), so
that Strata and llama-server can both serve it through HTTP (bench/side_by_side.py):

    .venv/bin/python -m bench.random_gguf --mix Q4_K_M [--shape smollm2-1.7b]   # prints the path

The weights are random valid blocks (tests/helpers/quant_models.py): speed only, the text means
nothing, so sample (temperature 1) rather than decode greedily, or prompt lookup guesses it.
Written once under the temporary folder and reused."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.quant_speed import SHAPES
from engine.files import default_model_path
from tests.helpers.quant_models import write_mix


def random_gguf(mix: str, shape: str) -> Path:
    path = Path(tempfile.gettempdir()) / "strata-bench-cache" / f"random-{shape}-{mix}-tokenizer.gguf"
    path.parent.mkdir(exist_ok=True)
    if not path.exists():
        started = time.perf_counter()
        write_mix(path.with_suffix(".tmp"), mix, SHAPES[shape], quantize_small=False, tokenizer_of=default_model_path())
        path.with_suffix(".tmp").replace(path)
        print(f"wrote {path} in {time.perf_counter() - started:.0f}s")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mix", default="Q4_K_M")
    parser.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    args = parser.parse_args()
    print(random_gguf(args.mix, args.shape))


if __name__ == "__main__":
    main()
