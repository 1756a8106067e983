"""A GGUF file as the loader uses it, read with gguf's own `GGUFReader` (the format's reference
reader; we do not parse GGUF ourselves): metadata by key, read on demand, and each tensor's raw
bytes, a view of the memory-mapped file, so weights come from the page cache only when a loader
asks for them. No torch here.

GGUFReader reads every metadata field when it opens a file, the 49k-entry vocabulary included:
about 2 s of a worker's start for the default model. With a cache folder, what it found (the
small fields, each tensor's place in the file) is kept beside the converted tokenizer, keyed by
the file's path, size and mtime, and a later start maps the tensors straight from it; a large
field (the vocabulary) is still read with GGUFReader, only if someone asks for it."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
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


INDEX_VERSION = 1
LARGE = 64  # array fields longer than this (vocabulary, merges) are not kept in the index


class _Fields(Mapping):
    """Metadata key -> value (str, int, float, bool, or a list of them), converted when asked: the
    loader reads a dozen keys, not the 49k-entry vocabulary (the tokenizer has its own cache)."""

    def __init__(self, small: dict[str, Any], large: list[str], reader: Callable[[], GGUFReader]) -> None:
        self._small, self._large, self._reader = small, set(large), reader

    def __getitem__(self, key: str) -> Any:
        if key in self._small:
            return self._small[key]
        if key in self._large:
            return self._reader().fields[key].contents()
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._large  # without reading a large field

    def __iter__(self) -> Iterator[str]:
        return iter([*self._small, *sorted(self._large)])

    def __len__(self) -> int:
        return len(self._small) + len(self._large)


def _index(reader: GGUFReader) -> dict[str, Any]:
    """What the loader needs from a GGUFReader, as JSON."""
    small, large = {}, []
    for key, field in reader.fields.items():
        if len(field.data) > LARGE:
            large.append(key)
        else:
            value = field.contents()
            small[key] = value.tolist() if isinstance(value, np.ndarray) else value
    tensors = [[t.name, [int(d) for d in reversed(t.shape)], int(t.tensor_type), int(t.data_offset), int(t.n_bytes)]
               for t in reader.tensors]
    return {"version": INDEX_VERSION, "fields": small, "large": large, "tensors": tensors}


def _index_path(path: Path, cache_dir: Path) -> Path:
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / f"gguf-index-{key}.json"


class GGUFFile:
    """`fields`: metadata by key. `tensors`: name -> GGUFTensor, in file order. `cache_dir`: where
    the index of the file is kept between starts (None: GGUFReader every time)."""

    def __init__(self, path: str | Path, cache_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self._reader: GGUFReader | None = None
        index = None
        where = _index_path(self.path, Path(cache_dir)) if cache_dir is not None else None
        if where is not None and where.exists():
            try:
                index = json.loads(where.read_text())
                if index.get("version") != INDEX_VERSION:
                    index = None
            except (OSError, ValueError):
                index = None  # a torn or foreign file: read the GGUF again
        if index is None:
            index = _index(self.reader())
            if where is not None:
                where.parent.mkdir(parents=True, exist_ok=True)
                tmp = where.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(index))
                tmp.replace(where)  # whole or absent, even with several workers starting at once
        self.fields: Mapping[str, Any] = _Fields(index["fields"], index["large"], self.reader)
        mapped = self._mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors: dict[str, GGUFTensor] = {
            name: GGUFTensor(name, tuple(shape), GGMLQuantizationType(qtype), mapped[offset:offset + n_bytes])
            for name, shape, qtype, offset, n_bytes in index["tensors"]
        }

    def drop_pages(self) -> None:
        """Unmap the file's pages from this process once the model is built (madvise DONTNEED):
        what was converted at load (int4 groups, dequantized matrices) no longer counts in its
        RSS, and blocks kept as the file's pages (engine/quants) fault back in from the page cache
        at their first use. Nothing is lost: the mapping is read-only and backed by the file."""
        mapped = getattr(self._mapped, "_mmap", None)
        if mapped is not None and hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    def reader(self) -> GGUFReader:
        if self._reader is None:
            self._reader = GGUFReader(self.path)
        return self._reader
