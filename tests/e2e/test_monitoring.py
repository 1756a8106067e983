"""The monitoring of docker-compose.yml for real: Debian's Prometheus, run with the flags of the
compose service and the repository's prometheus.yml (its target pointed at a live `strata serve
--engine fake`), scrapes /metrics while requests of two priorities run, one read giving way; then
every query of the provisioned Grafana dashboard is evaluated by that Prometheus and must answer
with series. A metric renamed in api/prometheus.py, or a query that does not parse, fails here."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from queues.server import free_port
from queues.settings import environ_without_settings
from tests.e2e.conftest import MODEL, healthy, start, stop, wait_until
from tests.processes import spawn, system_binary

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "strata.json"
LOW, HIGH = -10, 10


def binary(name: str) -> str:
    """Prometheus' own binaries; CI installs them (.ci/run: apt-get install prometheus)."""
    return system_binary(name, "prometheus")


@dataclass
class Monitored:
    api: str
    prometheus: str

    def query(self, expr: str) -> list[dict]:
        answer = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]


def compose_prometheus(config: Path, data: Path, listen: str) -> list[str]:
    """The compose service's command, its container paths mapped onto this machine."""
    service = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["prometheus"]
    argv = []
    for flag in service["command"]:
        flag = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", flag)  # compose's defaults, no .env
        flag = flag.replace("/etc/prometheus/prometheus.yml", str(config)).replace("=/prometheus", f"={data}")
        argv.append(flag)
    return [binary("prometheus"), *argv, f"--web.listen-address={listen}"]


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    folder = tmp_path_factory.mktemp("monitoring")
    repo_config = ROOT / "monitoring" / "prometheus" / "prometheus.yml"
    checked = subprocess.run([binary("promtool"), "check", "config", str(repo_config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    port, prom_port = free_port(), free_port()
    config = yaml.safe_load(repo_config.read_text())
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    env = environ_without_settings()
    m = Monitored(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}")
    started: list[subprocess.Popen] = []
    try:
        started.append(start("serve", env, "--engine", "fake", "--port", str(port), "--data-dir", str(folder / "data"),
                             "--parallel", "2", "--prefill-chunk", "16", "--fake-read-ms-per-token", "5",
                             "--fake-decode-ms-per-step", "10", "--metrics-priorities", json.dumps([LOW, 0, HIGH])))
        with open(folder / "prometheus.log", "wb") as log:
            started.append(spawn(compose_prometheus(folder / "prometheus.yml", folder / "tsdb", f"127.0.0.1:{prom_port}"),
                                 stdout=log, stderr=subprocess.STDOUT))
        wait_until(lambda: healthy(m.api), "the API", 120)
        wait_until(lambda: MODEL in [x["id"] for x in httpx.get(f"{m.api}/v1/models").json()["data"]], "the worker", 60)
        wait_until(lambda: _ready(m.prometheus), "Prometheus", 60)
        yield m
    finally:
        for process in reversed(started):
            stop(process, 60)


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def background(m: Monitored, content: str, priority: int, max_tokens: int) -> str:
    r = httpx.post(f"{m.api}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "priority": priority, "background": True})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def status(m: Monitored, rid: str) -> str:
    return httpx.get(f"{m.api}/v1/requests/{rid}", timeout=10).json()["status"]


def give_way(m: Monitored) -> None:
    """A long low-priority read, then a short high-priority request that it gives way to."""
    long_read = background(m, "words " * 300, LOW, 4)
    wait_until(lambda: status(m, long_read) == "running", "the long read", 30)
    urgent = background(m, "Now.", HIGH, 4)
    wait_until(lambda: status(m, long_read) == status(m, urgent) == "finished", "both", 60)


def test_every_dashboard_query_answers_from_a_real_prometheus_scraping_the_api(monitored: Monitored):
    m = monitored
    give_way(m)
    others = [background(m, f"Request {i}.", p, 6) for i, p in enumerate((0, LOW, HIGH, 0))]
    wait_until(lambda: all(status(m, r) == "finished" for r in others), "every request", 60)
    # a second give-way after Prometheus has scraped the first: the rate panel then has two points to differ
    wait_until(lambda: m.query("sum(strata_give_ways_total) >= 1"), "Prometheus to see the first give-way", 30)
    give_way(m)
    metrics = httpx.get(f"{m.api}/metrics", timeout=10).text
    gave_way = re.search(rf'^strata_give_ways_total{{model="{re.escape(MODEL)}",priority="{LOW}"}} (\S+)$', metrics, re.M)
    assert gave_way and float(gave_way.group(1)) >= 1, [line for line in metrics.splitlines() if "give_ways" in line]
    # Prometheus has scraped the end state (and a few earlier scrapes for rates)
    wait_until(lambda: m.query('sum(strata_requests_ended_total{status="finished"}) >= 8')
               and m.query("sum(strata_give_ways_total) >= 2"), "Prometheus to scrape the ended requests", 30)
    wait_until(lambda: m.query("count_over_time(strata_workers_live[1m]) >= 5"), "five scrapes", 30)

    dashboard = json.loads(DASHBOARD.read_text())
    variable = dashboard["templating"]["list"][0]
    metric = re.fullmatch(r"label_values\((\w+), model\)", variable["query"]["query"]).group(1)
    models = httpx.get(f"{m.prometheus}/api/v1/label/model/values", params={"match[]": metric}, timeout=10).json()
    assert MODEL in models["data"]
    titles = set()
    for panel in dashboard["panels"]:
        titles.add(panel["title"])
        for target in panel["targets"]:
            # Grafana's variables as Grafana would fill them for this model
            expr = target["expr"].replace("$model", MODEL).replace("$__rate_interval", "1m")
            assert m.query(expr), (panel["title"], expr)
    assert {"Waiting by priority", "Time to first token by priority (p50, p95, p99)", "Slots busy by worker",
            "Give-ways by priority"} <= titles
    ttft = next(p for p in dashboard["panels"] if p["title"].startswith("Time to first token"))
    by_priority = m.query(ttft["targets"][2]["expr"].replace("$model", MODEL)
                          .replace("$__rate_interval", "1m"))
    assert {s["metric"]["priority"] for s in by_priority} >= {str(LOW), "0", str(HIGH)}
    give_ways = next(p for p in dashboard["panels"] if p["title"] == "Give-ways by priority")
    rates = m.query(give_ways["targets"][0]["expr"].replace("$model", MODEL)
                    .replace("$__rate_interval", "1m"))
    assert [s["metric"]["priority"] for s in rates if float(s["value"][1]) > 0] == [str(LOW)]
