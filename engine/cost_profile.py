"""What the real engine costs on one machine, as `strata calibrate` measured it: the time of one
prompt chunk by the context already cached and the chunk's length, and of one decode step by
the number of rows and the longest context among them; and what the worker loop itself costs
per step beside the engine (step_overhead_ms). The fake engine reads its clock costs
from it (FakeEngine(profile=...)), so a simulation waits as long as the measured engine would.

Pure Python (no torch): the simulator and the tests load profiles without the engine. Between
measured points costs are interpolated linearly; beyond the last point they follow the last
segment (prefill and attention grow about linearly there), never below zero."""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

FORMAT = 1


class ProfileError(ValueError):
    """A cost profile file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class CostGrid:
    """ms[i][j]: the cost at rows[i] and columns[j] (read: rows are contexts, columns chunk
    lengths; decode: rows are batch sizes, columns contexts)."""

    rows: list[int]
    columns: list[int]
    ms: list[list[float]]

    def __post_init__(self) -> None:
        if not self.rows or not self.columns:
            raise ValueError("a cost grid needs at least one row and one column")
        if sorted(set(self.rows)) != list(self.rows) or sorted(set(self.columns)) != list(self.columns):
            raise ValueError("a cost grid's rows and columns must be strictly increasing")
        if len(self.ms) != len(self.rows) or any(len(r) != len(self.columns) for r in self.ms):
            raise ValueError(f"a cost grid of {len(self.rows)} rows x {len(self.columns)} columns "
                             f"needs that many values")

    def at(self, row: float, column: float) -> float:
        across = [interpolate(self.columns, values, column) for values in self.ms]
        return max(0.0, interpolate(self.rows, across, row))


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), extended by the first and last segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CostProfile:
    read: CostGrid  # rows: tokens already cached; columns: chunk length; ms per chunk
    decode: CostGrid  # rows: slots decoded together; columns: longest context; ms per step
    machine: dict[str, str] = field(default_factory=dict)  # what was measured: model, device, dtype, threads, when
    # the worker loop's own cost per busy step beside the engine (Python, Redis round trips);
    # 0 in profiles written before it was measured
    step_overhead_ms: float = 0.0

    def read_ms(self, cached: int, tokens: int) -> float:
        """One read of `tokens` prompt tokens into a slot that holds `cached`."""
        return self.read.at(cached, tokens)

    def decode_ms(self, rows: int, context: int) -> float:
        """One decode step of `rows` slots, the longest holding `context` tokens."""
        return self.decode.at(rows, context)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> "CostProfile":
        if data.get("format") != FORMAT:
            raise ValueError(f"cost profile format {data.get('format')!r}; this Strata reads format {FORMAT}")
        try:
            return cls(CostGrid(**data["read"]), CostGrid(**data["decode"]),
                       {str(k): str(v) for k, v in data.get("machine", {}).items()},
                       float(data.get("step_overhead_ms", 0.0)))
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a cost profile: {error}") from None

    @classmethod
    def load(cls, path: Path) -> "CostProfile":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as error:
            raise ProfileError(f"{path}: cannot read it ({error.strerror}); run `strata calibrate` first") from None
        except ValueError as error:
            raise ProfileError(f"{path}: {error}") from None
