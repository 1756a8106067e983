"""A GGUF file as the loader uses it, read with gguf's own `GGUFReader` (the format's reference
reader; we do not parse GGUF ourselves): metadata by key, read on demand, and each tensor's raw
bytes, a view of the memory-mapped file, so weights come from the page cache only when a loader
asks for them. No torch here."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: outermost first ([out, in] for a matrix)
    qtype: GGMLQuantizationType
    data: np.ndarray  # the raw bytes (uint8), a read-only view of the mapped file

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size

    def rows(self) -> np.ndarray:
        """The raw bytes as [rows, row_bytes] (every row is whole blocks)."""
        return self.data.reshape(-1, self.row_bytes)


class _Fields(Mapping):
    """Metadata key -> value (str, int, float, bool, or a list of them), converted when asked: the
    loader reads a dozen keys, not the 49k-entry vocabulary (the tokenizer has its own cache)."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def __getitem__(self, key: str) -> Any:
        return self._fields[key].contents()

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


class GGUFFile:
    """`fields`: metadata by key. `tensors`: name -> GGUFTensor, in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        reader = GGUFReader(self.path)
        self.fields: Mapping[str, Any] = _Fields(reader)
        self.tensors: dict[str, GGUFTensor] = {
            t.name: GGUFTensor(t.name, tuple(int(d) for d in reversed(t.shape)), GGMLQuantizationType(t.tensor_type),
                               np.asarray(t.data).view(np.uint8).reshape(-1))
            for t in reader.tensors
        }
