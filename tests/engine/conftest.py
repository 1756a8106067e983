"""Shared engine fixtures. The real SmolLM2 file is opened once per session."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class LoadedSmolLM2:
    path: object
    config: object
    gguf: object  # engine.gguf_loader.GGUFModel: the weight source (dense, int4 blocks, rows)
    tokenizer: object


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> LoadedSmolLM2:
    from engine.files import default_model_path
    from engine.gguf_loader import GGUFModel
    from engine.tokenizer import Tokenizer

    path = default_model_path()
    gguf = GGUFModel(path)
    tokenizer = Tokenizer.from_model_path(path, extra_eos_ids=gguf.eos_token_ids())
    return LoadedSmolLM2(path=path, config=gguf.config, gguf=gguf, tokenizer=tokenizer)


def make_engine(loaded: LoadedSmolLM2, dtype: torch.dtype, num_slots: int = 4, ctx: int = 512, int4: bool = True):
    """int4 applies to bf16 only (the file's Q4_1 blocks); float32 is the dequantized reference."""
    from engine.load import build_engine

    return build_engine(loaded.config, loaded.gguf, loaded.tokenizer, num_slots=num_slots, ctx=ctx,
                        device=torch.device("cpu"), dtype=dtype, int4=int4)


@pytest.fixture(scope="session")
def smollm2_f32(smollm2: LoadedSmolLM2):
    return make_engine(smollm2, torch.float32)


@pytest.fixture(scope="session")
def smollm2_default(smollm2: LoadedSmolLM2):
    """What `strata serve` runs on the CPU for this file: bf16 activations, int4 linears."""
    return make_engine(smollm2, torch.bfloat16)


@pytest.fixture(scope="session")
def new_smollm2_engine(smollm2: LoadedSmolLM2):
    """A factory: new_smollm2_engine(dtype, num_slots=..., ctx=..., int4=...) over the session's file."""
    return lambda dtype, **kwargs: make_engine(smollm2, dtype, **kwargs)


@pytest.fixture(scope="session")
def tiny_packages(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The tiny engine's two packages (tests/helpers/tiny_engine.py: float32, the head inside),
    built once a session by `compile_decode` in a cache folder of their own: a build is ~30-50 s
    of 2 busy cores, and the tests that only run them took one each. The paths, one row first;
    empty if the build failed (then every test that takes them fails on its own checks)."""
    from tests.helpers.tiny_engine import tiny_engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("tiny-packages")))
        engine = tiny_engine()
        engine.compile_decode(warm=True)
        return [p.path for p in engine.compiled.packaged]


@pytest.fixture
def tiny_package_cache(tiny_packages: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own inductor cache folder (TORCHINDUCTOR_CACHE_DIR) holding a copy of the tiny
    engine's packages: a tiny engine loads them there, neither exporting nor compiling."""
    folder = tmp_path / "strata-aot"
    folder.mkdir()
    for path in tiny_packages:
        shutil.copy(path, folder)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path


def prefill_logits(model, slot: int, ids: list[int], start: int = 0) -> torch.Tensor:
    """Logits [V] of the last of `ids` read into `slot` at `start` (model level, no engine state)."""
    from engine.model import CacheIndex

    with torch.inference_mode():
        return model.logits(model(torch.tensor([ids]), CacheIndex.for_read(slot, start, start + len(ids))))[0]


def decode_logits(model, slots: list[int], tokens: list[int], positions: list[int], span: int = 256) -> torch.Tensor:
    """Logits [B, V] of one decode step (model level, no engine state)."""
    from engine.model import CacheIndex

    index = CacheIndex.for_slots(slots, torch.tensor(positions).unsqueeze(1), span)
    with torch.inference_mode():
        return model.logits(model(torch.tensor(tokens).unsqueeze(1), index))
