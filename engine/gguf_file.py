"""A GGUF file's metadata and raw tensor bytes, parsed once.

gguf's own `GGUFReader` builds a numpy view for every part of every field, which took ~2 s for
SmolLM2's 49k-token vocabulary and merges (and transformers' tokenizer reads the file again with
it). This reads the header with `struct` in one pass (~0.1 s) and maps the tensor data with
numpy, so weights are read from the page cache only when a loader asks for them. No torch here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUFValueType -> struct format of a scalar (8 = string, 9 = array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


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


class GGUFFile:
    """`fields`: metadata key -> value (str, int, float, bool, or a list of them; numeric arrays as
    numpy arrays). `tensors`: name -> GGUFTensor, in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self._map)
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (need 2 or later)")
        self._buf, self._offset = buf, 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._offset)
            self._offset += 8 * n_dims
            qtype = GGMLQuantizationType(self._u32())
            (offset,) = struct.unpack_from("<Q", buf, self._offset)
            self._offset += 8
            infos.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, qtype, offset in infos:
            block, size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape, dtype=np.int64)) // block * size
            data = self._map[start + offset : start + offset + nbytes]
            self.tensors[name] = GGUFTensor(name, shape, qtype, data)
        del self._buf

    def _u32(self) -> int:
        (value,) = struct.unpack_from("<I", self._buf, self._offset)
        self._offset += 4
        return value

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buf, self._offset)
        start = self._offset + 8
        self._offset = start + length
        return str(self._buf[start : self._offset], "utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == 8:
            return self._string()
        if vtype == 9:
            item_type = self._u32()
            (count,) = struct.unpack_from("<Q", self._buf, self._offset)
            self._offset += 8
            if item_type in _NUMPY:  # numeric arrays (token scores, types) in one read
                dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
                array = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._offset)
                self._offset += count * dtype.itemsize
                return array.copy()
            return [self._value(item_type) for _ in range(count)]
        fmt = _SCALARS[vtype]
        (value,) = struct.unpack_from("<" + fmt, self._buf, self._offset)
        self._offset += struct.calcsize(fmt)
        return value
