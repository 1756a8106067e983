"""`strata calibrate` and `strata simulate` options. Both are WorkerSettings — a simulated
worker takes every flag a real one does (--parallel, --prefill-chunk, --reserve, --aging-s, ...)
and calibrate loads the engine a worker would — plus their own few."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import CliPositionalArg, SettingsConfigDict

from queues.settings import QueueLimits
from workers.settings import WorkerSettings

DEFAULT_PROFILE = Path("data/cost-profile.json")  # where `strata calibrate` writes by default


def bundled_profile() -> Path:
    """Measured on the development machine (2 shared CPU cores, SmolLM2-135M Q4_1, bf16 + int4,
    one torch thread: bench/sim_fidelity's profile, docs/simulate.md): used when this machine
    has not been calibrated."""
    return Path(__file__).parent / "profiles" / "cpu-smollm2.json"


class CalibrateSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="STRATA_", extra="ignore")

    out: Path = Field(DEFAULT_PROFILE, description="where the cost profile (JSON) is written")
    quick: bool = Field(False, description="a few points, one try each: seconds, for tests and a first look")


class SimulateSettings(WorkerSettings, QueueLimits):
    model_config = SettingsConfigDict(env_prefix="STRATA_", extra="ignore")

    workload: CliPositionalArg[Path] = Field(description="YAML or JSON file of traffic classes and/or recorded requests")
    profile: Path | None = Field(None, description=f"cost profile from `strata calibrate`; default {DEFAULT_PROFILE} "
                                                   "if it exists, else the one measured on the development CPU")
    workers: int = Field(1, ge=1, description="simulated workers (one per GPU), each with --parallel slots")
    seed: int | None = Field(None, description="arrivals' seed; default the workload file's")
    ignore_priority: bool = Field(False, description="send every request at priority 0 (reported by its class's): "
                                                     "what the service does without priorities")
    compare: list[str] = Field([], description="run again on the same arrivals with these settings changed, side by "
                                               "side: --compare reserve=1:10 --compare aging_s=30")
    out: Path | None = Field(None, description="folder for summary.json and the plots (ttft_cdf.png, queue_length.png)")
    drain_s: float = Field(3600.0, gt=0, description="after the last arrival, stop at the latest this much later")
    exact_reports: bool = Field(False, description="send every step's report to Redis, as production does "
                                                   "(slower; same schedule, see simulate/fleet.py)")

    @field_validator("compare")
    @classmethod
    def _pairs(cls, value: list[str]) -> list[str]:
        for item in value:
            name, sep, _ = item.partition("=")
            if not sep or name.replace("-", "_") not in cls.model_fields:
                raise ValueError(f"--compare {item!r}: expected SETTING=VALUE with a simulate setting, e.g. reserve=1:10")
        return value

    def profile_path(self) -> Path:
        if self.profile is not None:
            return self.profile
        return DEFAULT_PROFILE if DEFAULT_PROFILE.exists() else bundled_profile()

    def variant(self) -> "SimulateSettings":
        """The --compare configuration: these settings with its changes (validated like flags)."""
        changes: dict[str, object] = {}
        for item in self.compare:
            name, _, value = item.partition("=")
            name = name.replace("-", "_")
            if name == "reserve":  # repeatable; `reserve=` alone: no reserved slots
                changes.setdefault(name, []).extend([value] if value else [])
            else:
                changes[name] = value if value else None  # `aging_s=`: back to its default off
        data = self.model_dump(exclude={"compare"})
        return type(self).model_validate({**data, **changes, "compare": []})
