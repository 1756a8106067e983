"""Shared engine fixtures. The real SmolLM2 file is opened once per session."""

from __future__ import annotations

import os
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
    """What `strata serve` runs on the CPU for this file: bf16 activations, linears on the file's
    Q4_1 blocks (`q4_forms`)."""
    return make_engine(smollm2, torch.bfloat16)


@pytest.fixture(scope="session")
def new_smollm2_engine(smollm2: LoadedSmolLM2):
    """A factory: new_smollm2_engine(dtype, num_slots=..., ctx=..., int4=...) over the session's file."""
    return lambda dtype, **kwargs: make_engine(smollm2, dtype, **kwargs)


@pytest.fixture
def packages(request: pytest.FixtureRequest, early_jobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """This test's own inductor cache folder (tmp_path, as TORCHINDUCTOR_CACHE_DIR) holding the
    packages its `early` jobs built in another process (tests/helpers/early.py): the copies'
    paths. Its engine finds them there by their key, neither exporting nor compiling."""
    from tests.helpers.early import copy_packages, result

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    copies = []
    for mark in request.node.iter_markers("early"):
        for job in mark.args:
            copies += copy_packages(result(early_jobs, job, tmp_path / "early"), tmp_path)
    return copies


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


def q4_forms(linears: int, prompt_copy: bool = True) -> dict[str, int]:
    """The forms a Q4_0/Q4_1 file's `linears` get in bf16 on this CPU (Transformer.build): the
    file's blocks on `strata_quants::mm` (repacked eight rows at a time where its AVX2 builds run)
    with, where oneDNN prepacks bf16, a prepacked bf16 copy for prompts (`prompt_copy`, the
    engine's default) unless the blocks' bf16 tile reads them (`bf16_prompt_here`); torch's int4
    kernel instead where oneDNN prepacks bf16 but kernel.cpp runs its portable build."""
    from engine.quants.blocks import bf16_prompt_here, repack_here
    from engine.weights import can_prepack

    if not can_prepack():
        return {"quant": linears}
    form = "quant" if repack_here() else "int4"
    copy = prompt_copy and not (form == "quant" and bf16_prompt_here())
    return {f"{form}+bf16-packed": linears} if copy else {form: linears}
