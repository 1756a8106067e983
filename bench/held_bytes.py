"""Weight memory of a GGUF kept as its blocks, per llama.cpp mix: the bytes of every tensor the
model holds (engine.quants.blocks.held_bytes, KV cache aside) against the file's tensor bytes, on
the tiny models tests/engine/test_quants.py writes (2 layers, dim 256). docs/engine.md's table.

    PYTHONPATH=. .venv/bin/python -m bench.held_bytes
    PYTHONPATH=. .venv/bin/python -m bench.held_bytes --files "$(.venv/bin/python -m bench.family_gguf --mix Q4_K_M | tail -1)"

`--files`: those GGUFs instead (a real model's shape: an MoE's experts are most of its bytes).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

MIXES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q5_0", "IQ4_XS", "IQ3_S"]


def main() -> None:
    from engine.gguf_loader import GGUFModel
    from engine.model import Transformer
    from engine.quants import blocks as quants
    from tests.helpers.quant_models import write_mix

    from gguf import GGUFReader

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="*", type=Path, default=[])
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    print("| mix | file tensor bytes | held | ratio |\n|---|---|---|---|")
    for name in args.files or MIXES:
        if isinstance(name, Path):
            path, name = name, name.name
            file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
        else:
            path = folder / f"tiny-{name}.gguf"
            file_bytes = write_mix(path, name)
        loaded = GGUFModel(path)
        model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=torch.device("cpu"), int4=True)
        held = quants.held_bytes(model)
        print(f"| {name} | {file_bytes:,} | {held:,} | {held / file_bytes:.3f} |".replace(",", " "), flush=True)
        del model, loaded


if __name__ == "__main__":
    main()
