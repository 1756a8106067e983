"""A GGUF file as the loader uses it: metadata by key, read on demand, and each tensor's raw
bytes, a view of the memory-mapped file, so weights come from the page cache only when a loader
asks for them. No torch here. We do not parse GGUF ourselves: transformers' GGUF metadata reader
(`transformers.integrations.gguf`, struct-based) reads the header, checked field for field and byte
for byte against gguf's reference `GGUFReader` (tests/engine/test_gguf_loader.py).

Why not GGUFReader itself: it builds a numpy view per vocabulary string, ~2 s of a quiet start for
SmolLM2's 49k tokens and merges (6 s under load), where the struct reader takes ~0.5 s, and the
first token of a fresh `strata serve` waits on it (issue 24). With a cache folder, what it found
(the small fields, each tensor's place in the file) is kept beside the converted tokenizer, keyed
by the file's path, size and mtime, and a later start maps the tensors straight from it; a large
field (the vocabulary) is read again only if someone asks for it."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


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


INDEX_VERSION = 2  # 2: read with transformers' reader (same fields; 1's entries are rebuilt)
LARGE = 64  # array fields longer than this (vocabulary, merges) are not kept in the index


class _Fields(Mapping):
    """Metadata key -> value (str, int, float, bool, or a list of them), converted when asked: the
    loader reads a dozen keys, not the 49k-entry vocabulary (the tokenizer has its own cache)."""

    def __init__(self, small: dict[str, Any], large: list[str], read: Callable[[str], Any]) -> None:
        self._small, self._large, self._read = small, set(large), read

    def __getitem__(self, key: str) -> Any:
        if key in self._small:
            return self._small[key]
        if key in self._large:
            return self._read(key)
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._large  # without reading a large field

    def __iter__(self) -> Iterator[str]:
        return iter([*self._small, *sorted(self._large)])

    def __len__(self) -> int:
        return len(self._small) + len(self._large)


class _EveryKey:
    """`string_arrays` for transformers' reader: keep every string array (it would otherwise leave
    one as its length, indistinguishable from an integer field)."""

    def __contains__(self, key: object) -> bool:
        return True


def _index(path: Path) -> dict[str, Any]:
    """What the loader needs from the file's header, as JSON. The header is walked with the struct
    reader's two steps (its public `read_gguf_metadata` gives tensor names only, and `GgufHeader`
    refuses block types transformers cannot dequantize, which engine/quants can); sizes come from
    gguf's own block table."""
    from transformers.integrations.gguf import reader

    blob = reader._mapped(str(path))
    metadata, count, end = reader._read_metadata(blob, str(path), _EveryKey())
    entries, end = reader._read_tensor_table(blob, count, end)
    alignment = int(metadata.get("general.alignment", 32))  # llama.cpp's default
    data_start = (end + alignment - 1) // alignment * alignment
    small, large = {}, []
    for key, value in metadata.items():
        if isinstance(value, list) and len(value) > LARGE:
            large.append(key)
        else:
            small[key] = value
    tensors = []
    for name, shape, qtype, offset in entries:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        tensors.append([name, [int(d) for d in shape], int(qtype), data_start + int(offset),
                        math.prod(shape) // block * size])
    return {"version": INDEX_VERSION, "fields": small, "large": large, "tensors": tensors}


def _large_field(path: Path, key: str) -> Any:
    from transformers.integrations.gguf import read_gguf_metadata

    return read_gguf_metadata(str(path), (key,))[0][key]


def _index_path(path: Path, cache_dir: Path) -> Path:
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / f"gguf-index-{key}.json"


class GGUFFile:
    """`fields`: metadata by key. `tensors`: name -> GGUFTensor, in file order. `cache_dir`: where
    the index of the file is kept between starts (None: GGUFReader every time)."""

    def __init__(self, path: str | Path, cache_dir: str | Path | None = None) -> None:
        self.path = Path(path)
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
            index = _index(self.path)
            if where is not None:
                where.parent.mkdir(parents=True, exist_ok=True)
                tmp = where.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(index))
                tmp.replace(where)  # whole or absent, even with several workers starting at once
        self.fields: Mapping[str, Any] = _Fields(index["fields"], index["large"], lambda key: _large_field(self.path, key))
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
        self._dont_need(0, len(self._mapped))

    def drop_tensor_pages(self, name: str) -> None:
        """`drop_pages` for one tensor's whole pages (a page it shares with a neighbour stays), as
        soon as the model holds it in a form of its own (repacked at load): the load's peak then
        holds each such matrix once, not the file's pages and the copy together."""
        data = self.tensors[name].data
        start = data.ctypes.data - self._mapped.ctypes.data  # the mapping starts at the file's first byte
        lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            self._dont_need(lo, hi - lo)

    def _dont_need(self, start: int, length: int) -> None:  # start: a multiple of the page size
        mapped = getattr(self._mapped, "_mmap", None)
        if mapped is not None and hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED, start, length)
