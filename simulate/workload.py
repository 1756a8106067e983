"""The traffic a simulation replays: a YAML or JSON file of traffic classes (each a priority, an
arrival process — Poisson at a rate, or timestamps from a trace —, prompt and answer length
distributions, an optional queue_timeout) and/or recorded requests. Validated by pydantic, so a
mistake is reported with the field's path (`classes.1.rate_per_s: ...`).

    duration_s: 600
    seed: 1
    classes:
      - name: alerts
        priority: 10
        rate_per_s: 0.05
        prompt_tokens: 30
        max_tokens: {dist: uniform, low: 8, high: 32}
      - name: battery
        priority: -5
        at_s: [0, 0, 0, 0]            # or trace: arrivals.txt (one time in seconds per line)
        prompt_tokens: {dist: lognormal, median: 400, sigma: 0.6, max: 1800}
        max_tokens: 160
    requests:                       # recorded requests, as they came (or requests_file: a JSONL)
      - {at_s: 1.5, priority: 0, prompt_tokens: 1500, max_tokens: 4}

Arrivals are drawn from `seed` (one stream per class: adding a class does not move the
others), so the same file and seed give the same arrivals, and `--compare` replays them to
two configurations."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class WorkloadError(ValueError):
    """The workload file cannot be used; the message names the file and the field."""


class Lengths(BaseModel):
    """A token count distribution: constant, uniform (low..high inclusive), lognormal (median,
    sigma) or exponential (mean), rounded and clipped to min..max."""

    model_config = ConfigDict(extra="forbid")

    dist: Literal["constant", "uniform", "lognormal", "exponential"] = "constant"
    value: int | None = Field(None, ge=1)
    low: int | None = Field(None, ge=1)
    high: int | None = Field(None, ge=1)
    median: float | None = Field(None, gt=0)
    sigma: float = Field(0.5, ge=0)
    mean: float | None = Field(None, gt=0)
    min: int = Field(1, ge=1)
    max: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _bare_number(cls, data: object) -> object:
        return {"value": data} if isinstance(data, int) and not isinstance(data, bool) else data

    @model_validator(mode="after")
    def _complete(self) -> "Lengths":
        needs = {"constant": ("value",), "uniform": ("low", "high"), "lognormal": ("median",),
                 "exponential": ("mean",)}[self.dist]
        missing = [name for name in needs if getattr(self, name) is None]
        if missing:
            raise ValueError(f"dist {self.dist} needs {' and '.join(missing)}")
        if self.dist == "uniform" and self.low > self.high:
            raise ValueError("low must not exceed high")
        if self.max is not None and self.max < self.min:
            raise ValueError("max must not be below min")
        return self

    def draw(self, rng: random.Random) -> int:
        if self.dist == "constant":
            n = float(self.value)
        elif self.dist == "uniform":
            n = rng.randint(self.low, self.high)
        elif self.dist == "lognormal":
            n = rng.lognormvariate(math.log(self.median), self.sigma)
        else:
            n = rng.expovariate(1 / self.mean)
        n = max(self.min, round(n))
        return n if self.max is None else min(self.max, n)


class TrafficClass(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    priority: int = 0
    rate_per_s: float | None = Field(None, gt=0, description="Poisson arrivals at this mean rate")
    at_s: list[float] | None = Field(None, description="arrival times (s), as recorded")
    trace: Path | None = Field(None, description="file of arrival times (s), one per line")
    prompt_tokens: Lengths
    max_tokens: Lengths
    queue_timeout_s: float | None = Field(None, gt=0)
    shared_prefix_tokens: int = Field(0, ge=0, description="the first N prompt tokens are the same for every "
                                                           "request of the class (a system prompt, a few-shot header)")
    start_s: float = Field(0.0, ge=0, description="Poisson arrivals begin then")
    stop_s: float | None = Field(None, gt=0, description="Poisson arrivals end then (default: duration_s)")

    @model_validator(mode="after")
    def _one_arrival_process(self) -> "TrafficClass":
        given = [n for n in ("rate_per_s", "at_s", "trace") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of rate_per_s, at_s, trace (got {', '.join(given) or 'none'})")
        if self.at_s is not None and any(t < 0 for t in self.at_s):
            raise ValueError("at_s: arrival times must not be negative")
        return self


class RecordedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    at_s: float = Field(ge=0)
    priority: int = 0
    prompt_tokens: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    queue_timeout_s: float | None = Field(None, gt=0)
    name: str = "recorded"


class WorkloadFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    duration_s: float | None = Field(None, gt=0, description="Poisson arrivals stop then")
    seed: int = 0
    classes: list[TrafficClass] = []
    requests: list[RecordedRequest] = []
    requests_file: Path | None = Field(None, description="JSONL of recorded requests")

    @model_validator(mode="after")
    def _something(self) -> "WorkloadFile":
        if not (self.classes or self.requests or self.requests_file):
            raise ValueError("no traffic: give classes, requests or requests_file")
        if any(c.rate_per_s is not None and c.stop_s is None for c in self.classes) and self.duration_s is None:
            raise ValueError("duration_s is needed with Poisson classes (rate_per_s) that have no stop_s")
        return self


@dataclass(frozen=True)
class Arrival:
    id: str
    at_ms: int
    priority: int
    prompt_tokens: int
    max_tokens: int
    queue_timeout_ms: int | None
    name: str  # its traffic class
    shared_prefix_tokens: int = 0  # its first tokens, the same for every request of `group`
    group: int = 0


def load(path: Path) -> WorkloadFile:
    path = Path(path)
    try:
        raw = path.read_text()
    except OSError as error:
        raise WorkloadError(f"{path}: cannot read it ({error.strerror})") from None
    try:
        data = json.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise WorkloadError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {error}") from None
    return parse(data, path)


def parse(data: object, path: Path = Path("workload")) -> WorkloadFile:
    try:
        workload = WorkloadFile.model_validate(data)
    except ValidationError as error:
        raise WorkloadError(f"{path}: " + "; ".join(_describe(e) for e in error.errors())) from None
    return _resolve(workload, Path(path).parent)


def _describe(error: dict) -> str:
    where = ".".join(str(part) for part in error["loc"] if not str(part).startswith("function-after"))
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _resolve(workload: WorkloadFile, folder: Path) -> WorkloadFile:
    """Trace and request files are read now (relative to the workload file), so their errors name
    their field too."""
    classes = []
    for i, cls in enumerate(workload.classes):
        if cls.trace is not None:
            trace = cls.trace if cls.trace.is_absolute() else folder / cls.trace
            try:
                times = [float(line) for line in trace.read_text().split() if line]
            except (OSError, ValueError) as error:
                raise WorkloadError(f"classes.{i}.trace: {trace}: {error}") from None
            cls = cls.model_copy(update={"at_s": times, "trace": None})  # noqa: PLW2901
        classes.append(cls)
    requests = list(workload.requests)
    if workload.requests_file is not None:
        source = workload.requests_file if workload.requests_file.is_absolute() else folder / workload.requests_file
        try:
            lines = source.read_text().splitlines()
        except OSError as error:
            raise WorkloadError(f"requests_file: {source}: {error.strerror}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                requests.append(RecordedRequest.model_validate_json(line))
            except ValidationError as error:
                raise WorkloadError(f"requests_file: {source} line {n}: "
                                    + "; ".join(_describe(e) for e in error.errors())) from None
    return workload.model_copy(update={"classes": classes, "requests": requests, "requests_file": None})


def arrivals(workload: WorkloadFile, seed: int | None = None) -> list[Arrival]:
    """Every request of the workload, in arrival order (ties: class order, then draw order)."""
    seed = workload.seed if seed is None else seed
    out: list[tuple[int, int, int, Arrival]] = []
    for c, cls in enumerate(workload.classes):
        rng = random.Random(f"{seed}:{c}:{cls.name}")
        if cls.at_s is not None:
            times = sorted(cls.at_s)
        else:
            times, t = [], cls.start_s
            stop = cls.stop_s if cls.stop_s is not None else workload.duration_s
            while True:
                t += rng.expovariate(cls.rate_per_s)
                if t >= stop:
                    break
                times.append(t)
        timeout = None if cls.queue_timeout_s is None else round(cls.queue_timeout_s * 1000)
        for n, at in enumerate(times):
            arrival = Arrival(f"{cls.name}-{n}", round(at * 1000), cls.priority, cls.prompt_tokens.draw(rng),
                              cls.max_tokens.draw(rng), timeout, cls.name, cls.shared_prefix_tokens, c)
            out.append((arrival.at_ms, c, n, arrival))
    for n, req in enumerate(workload.requests):
        timeout = None if req.queue_timeout_s is None else round(req.queue_timeout_s * 1000)
        out.append((round(req.at_s * 1000), len(workload.classes), n,
                    Arrival(f"{req.name}-r{n}", round(req.at_s * 1000), req.priority, req.prompt_tokens,
                            req.max_tokens, timeout, req.name)))
    return [a for *_, a in sorted(out, key=lambda t: t[:3])]
