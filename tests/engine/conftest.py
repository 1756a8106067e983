"""Shared engine fixtures. The real SmolLM2 file is read once per session (reading it costs ~10 s)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class LoadedSmolLM2:
    path: object
    config: object
    weights: dict
    tokenizer: object
    int4_blocks: dict  # the file's Q4_1 blocks of the attention/MLP matrices (GGUFModel.int4_blocks)


@pytest.fixture(scope="session")
def smollm2() -> LoadedSmolLM2:
    from engine.files import default_model_path
    from engine.gguf_loader import GGUFModel
    from engine.tokenizer import Tokenizer

    path = default_model_path()
    gguf = GGUFModel(path)
    tokenizer = Tokenizer.from_model_path(path, extra_eos_ids=gguf.eos_token_ids())
    return LoadedSmolLM2(path=path, config=gguf.config, weights=gguf.weights(), tokenizer=tokenizer,
                         int4_blocks=gguf.int4_blocks())


def make_engine(loaded: LoadedSmolLM2, dtype: torch.dtype, num_slots: int = 4, ctx: int = 512, int4: bool = False):
    from engine.runner import build_engine

    return build_engine(
        loaded.config, loaded.weights, loaded.tokenizer, model_name="SmolLM2-135M-Instruct",
        num_slots=num_slots, ctx=ctx, device=torch.device("cpu"), dtype=dtype,
        int4_blocks=loaded.int4_blocks if int4 else None,
    )


@pytest.fixture(scope="session")
def smollm2_f32(smollm2: LoadedSmolLM2):
    return make_engine(smollm2, torch.float32)


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2: LoadedSmolLM2):
    return make_engine(smollm2, torch.bfloat16)


@pytest.fixture(scope="session")
def new_smollm2_engine(smollm2: LoadedSmolLM2):
    """A factory: new_smollm2_engine(dtype, num_slots=..., ctx=..., int4=...) over the session's loaded file."""
    return lambda dtype, **kwargs: make_engine(smollm2, dtype, **kwargs)
