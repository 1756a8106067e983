"""A worker's engine options reach the engine: what `strata worker` is told (flags or STRATA_
variables) is what `load_engine` is called with, not a default it never hears about."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine
from workers.main import build_engine
from workers.settings import WorkerSettings


@pytest.mark.parametrize("value", [True, False])
def test_the_prompt_arithmetic_repack_and_int4_options_reach_load_engine(monkeypatch, value):
    calls: list[dict] = []
    monkeypatch.setattr(engine, "load_engine", lambda path, **kwargs: calls.append({"path": path, **kwargs}))
    monkeypatch.setenv("STRATA_PROMPT_INT8", str(value).lower())
    monkeypatch.setenv("STRATA_REPACK", str(value).lower())
    settings = WorkerSettings(int4=value, prefill_bf16=value, prompt_lookup=value)
    build_engine(settings, Path("model.gguf"))
    (call,) = calls
    assert call["path"] == Path("model.gguf")
    assert (call["prompt_int8"], call["repack"], call["int4"], call["prefill_bf16"], call["prompt_lookup"]) == (value,) * 5
