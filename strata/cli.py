"""The `strata` command. Every option is a flag and a STRATA_ environment variable, because
each subcommand is a pydantic settings object."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, CliApp, CliSubCommand, SettingsConfigDict

from api.settings import ApiSettings
from engine.errors import ConfigError
from queues.settings import REDIS_URL_ALIASES, RedisSettings, one_definition
from simulate.settings import CalibrateSettings, SimulateSettings
from strata.batch import BatchCommand, BatchWorkerCommand
from strata.startup import fail
from workers.settings import WorkerSettings


one_definition(WorkerSettings, ApiSettings)  # serve composes both: each shared option is queues/settings.py's


class ServeCommand(WorkerSettings, ApiSettings):
    """Redis (embedded unless REDIS_URL is set), the API and one worker, supervised."""

    model_config = SettingsConfigDict(env_prefix="STRATA_", extra="ignore")

    redis_url: str | None = Field(
        None,
        validation_alias=REDIS_URL_ALIASES,
        description="use this Redis; unset: start an embedded one with its data in --data-dir",
    )
    redis_fsync: Literal["always", "everysec"] = Field(
        "everysec", description="embedded Redis's appendfsync. Either way it writes its append-only file before it "
                                "answers, so a killed Redis loses nothing; `always` also fsyncs first (a machine crash "
                                "loses nothing either) at 1-3 ms per worker step; `everysec` loses up to 1 s in a crash")
    restart_delay_s: float = Field(2.0, ge=0, description="wait before restarting a child that exited")
    api_workers: int = Field(1, ge=1, description="API processes answering on --port: serve binds the port once and "
                                                   "each replica accepts on that socket (more cores for HTTP)")
    devices: str = Field("auto", description="one worker per device: auto (every CUDA device, else cpu), cpu, "
                                             "or a list such as cuda:0,cuda:1")

    def cli_cmd(self) -> None:
        from strata.serve import serve

        sys.exit(serve(self))


class WorkerCommand(WorkerSettings):
    """One worker process on one device, pulling from REDIS_URL."""

    def cli_cmd(self) -> None:
        from workers.main import run_worker

        run_worker(self)


class ApiCommand(ApiSettings):
    """The HTTP API alone (stateless: run as many as you like)."""

    def cli_cmd(self) -> None:
        from api.app import run
        from strata.startup import listen

        # bound here unless a supervisor handed one over: a port in use is one line, exit code 2
        run(self, None if self.fd is not None else listen(self.host, self.port))


class QueuesCommand(BaseSettings):
    """Show what waits, in service order, and what each worker is doing."""

    model_config = SettingsConfigDict(env_prefix="STRATA_", extra="ignore")

    redis_url: str | None = Field(
        None, validation_alias=REDIS_URL_ALIASES,
        description="default: the embedded Redis of a running `strata serve` (see --data-dir)",
    )
    redis_cluster: bool = RedisSettings.model_fields["redis_cluster"]
    data_dir: Path = Field(Path("data"), description="where a running `strata serve` recorded its Redis")
    watch: bool = Field(False, description="refresh until Ctrl-C")
    interval_s: float = Field(1.0, gt=0, description="refresh period with --watch")
    limit: int = Field(50, ge=1, description="waiting requests shown per model")

    def cli_cmd(self) -> None:
        from strata.queues_view import show

        show(self.redis_url, self.data_dir, watch=self.watch, interval_s=self.interval_s, limit=self.limit,
             cluster=self.redis_cluster)


class CalibrateCommand(CalibrateSettings):
    """Time the real engine here (prefill by context and chunk, decode by batch and context)
    and write the cost profile `strata simulate` runs on."""

    def cli_cmd(self) -> None:
        from simulate.main import calibrate

        calibrate(self)


class SimulateCommand(SimulateSettings):
    """Replay a workload through the real worker loop and Lua scripts over the calibrated fake
    engine, on a virtual clock: per-priority waiting times, throughput, plots."""

    def cli_cmd(self) -> None:
        from engine.cost_profile import ProfileError
        from simulate.main import simulate
        from simulate.workload import WorkloadError

        try:
            simulate(self)
        except (WorkloadError, ProfileError) as error:
            sys.exit(f"strata simulate: {error}")


class Strata(BaseSettings):
    model_config = SettingsConfigDict(cli_prog_name="strata", cli_kebab_case=True, cli_implicit_flags=True)

    serve: CliSubCommand[ServeCommand]
    worker: CliSubCommand[WorkerCommand]
    api: CliSubCommand[ApiCommand]
    batch_worker: CliSubCommand[BatchWorkerCommand]
    batch: CliSubCommand[BatchCommand]
    queues: CliSubCommand[QueuesCommand]
    calibrate: CliSubCommand[CalibrateCommand]
    simulate: CliSubCommand[SimulateCommand]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    """Run one subcommand. A configuration that cannot work (a bad flag or STRATA_ variable, a model
    path that is not there, an architecture the engine lacks, a port in use, a KV cache beyond the
    free memory) is the operator's to fix: said in one line, exit code 2, no traceback. Ctrl-C ends
    any command quietly (exit code 130), during start-up too."""
    args = sys.argv[1:] if argv is None else argv
    command = next((a for a in args if not a.startswith("-")), "")
    try:
        CliApp.run(Strata, cli_args=args)
    except ValidationError as error:
        # which flag or variable, and what is wrong with it
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'settings'}: {e['msg']}" for e in error.errors())
        fail(command, f"invalid configuration: {problems}")
    except ConfigError as error:
        fail(command, str(error))
    except KeyboardInterrupt:
        sys.exit(130)
