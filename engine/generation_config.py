"""A Hugging Face folder's generation_config.json: the sampling defaults its authors chose, used
when a request sets none (shapes.rules). No torch here: the API reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json entries a request can also set, by their request field's name
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_path: str | Path) -> dict[str, float]:
    """The folder's defaults for FIELDS ({} for a GGUF file or a folder without the file).
    `do_sample: false` means greedy whatever its temperature says (transformers' rule)."""
    file = Path(model_path) / "generation_config.json"
    if not file.is_file():
        return {}
    config: dict[str, Any] = json.loads(file.read_text())
    defaults = {name: float(config[name]) for name in FIELDS
                if isinstance(config.get(name), (int, float)) and not isinstance(config.get(name), bool)}
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults
