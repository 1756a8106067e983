"""Strata on a real Redis Cluster: three masters on loopback (the server `strata serve` embeds,
with --cluster-enabled; the cluster formed from here with CLUSTER ADDSLOTS and CLUSTER MEET),
`strata serve` pointed at them by a REDIS_URL listing the nodes (API, worker, batch worker, and the
plain Redis serve starts for RQ beside a cluster), plus a second model (its own API and worker).
Fake-engine workers: the subject is the queue layer, and the fake's answer depends only on what
the slot holds, so a resumed answer must equal the undisturbed one exactly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from redis.crc import key_slot

from queues.connect import connect
from queues.keys import Keys, models_key
from queues.server import free_port, server_binary
from queues.settings import environ_without_settings
from tests import processes
from tests.e2e.conftest import MODEL, healthy, sse, start, stop, wait_until

MASTERS = 3
SLOTS = 16384  # Redis Cluster's hash slots
SEED = 11


@dataclass
class Cluster:
    ports: list[int]
    processes: list[subprocess.Popen]

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True)

    def port_of_slot(self, slot: int) -> int:
        with self.node(self.ports[0]) as node:
            for first, last, master, *_replicas in node.execute_command("CLUSTER", "SLOTS"):
                if first <= slot <= last:
                    return int(master[1])
        raise AssertionError(f"slot {slot} is served by no node")

    def port_of_model(self, model: str) -> int:
        return self.port_of_slot(key_slot(Keys(model).waiting.encode()))


def node_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10_000 > 65_535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
        return port


def start_node(folder: Path) -> tuple[int, subprocess.Popen]:
    port = node_port()
    node = folder / str(port)
    node.mkdir()
    with open(node / "redis.log", "wb") as log:
        process = processes.spawn(
            [server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--appendonly", "no", "--save", "", "--dir", str(node)],
            stdout=log, stderr=subprocess.STDOUT)
    return port, process


def form_cluster(cluster: Cluster) -> None:
    """What `redis-cli --cluster create ... --cluster-replicas 0` does, over redis-py: each node
    takes an equal range of the 16384 hash slots, the others meet the first, and every node then
    sees all of them and every slot covered."""
    count = len(cluster.ports)
    for i, port in enumerate(cluster.ports):
        with cluster.node(port) as node:
            # ADDSLOTS, not ADDSLOTSRANGE: Redis before 7.0 (a Debian redis-server in CI) lacks the latter
            node.execute_command("CLUSTER", "ADDSLOTS", *range(i * SLOTS // count, (i + 1) * SLOTS // count))
    for port in cluster.ports[1:]:
        with cluster.node(port) as node:
            node.execute_command("CLUSTER", "MEET", "127.0.0.1", cluster.ports[0])

    def formed(port: int) -> bool:
        with cluster.node(port) as node:
            info = dict(line.split(":", 1) for line in node.execute_command("CLUSTER", "INFO").split() if ":" in line)
            masters = {int(master[1]) for _first, _last, master, *_ in node.execute_command("CLUSTER", "SLOTS")}
        return (info["cluster_state"] == "ok" and int(info["cluster_known_nodes"]) == count
                and int(info["cluster_slots_assigned"]) == SLOTS and masters == set(cluster.ports))

    wait_until(lambda: all(formed(p) for p in cluster.ports), "cluster_state:ok on every node", 60)


@contextmanager
def running_cluster(folder: Path) -> Iterator[Cluster]:
    """Three masters, no replicas, every slot covered; every node stopped on the way out,
    whatever failed on the way in."""
    cluster = Cluster([], [])
    try:
        for _ in range(MASTERS):
            port, process = start_node(folder)
            cluster.ports.append(port)
            cluster.processes.append(process)
        for port in cluster.ports:
            wait_until(lambda p=port: _answers(cluster, p), f"node {port}", 15)
        form_cluster(cluster)
        yield cluster
    finally:
        for process in cluster.processes:
            processes.stop(process, 10)


def _answers(cluster: Cluster, port: int) -> bool:
    try:
        with cluster.node(port) as node:
            return bool(node.ping())
    except redis.exceptions.ConnectionError:
        return False


def other_model(cluster: Cluster) -> str:
    """A served name whose keys live on another node than MODEL's."""
    taken = cluster.port_of_model(MODEL)
    return next(name for name in (f"second-model-{i}" for i in range(100)) if cluster.port_of_model(name) != taken)


@dataclass
class Deployment:
    cluster: Cluster
    base: str  # serve's API (MODEL)
    base_b: str  # the second model's API
    model_b: str
    data: Path
    serve: subprocess.Popen

    def client(self) -> redis.cluster.RedisCluster:
        return connect(self.cluster.url, within_s=5)

    def worker_pid(self, model: str) -> int:
        with self.client() as client:
            [worker] = client.zrange(Keys(model).workers, 0, -1)
        return int(worker.rsplit("-", 2)[1])


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    folder = tmp_path_factory.mktemp("cluster")
    with running_cluster(folder) as cluster:
        port, port_b = free_port(), free_port()
        model_b = other_model(cluster)
        env = environ_without_settings()
        fake = ["--engine", "fake", "--fake-decode-ms-per-step", "20", "--lease-ms", "3000", "--heartbeat-s", "0.5"]
        started: list[subprocess.Popen] = []
        try:
            serve = start("serve", env, "--redis-url", cluster.url, "--port", str(port), "--data-dir",
                          str(folder / "data"), "--parallel", "2", "--restart-delay-s", "0.5", *fake)
            started.append(serve)
            rq_address = folder / "data" / "rq" / "redis.url"
            # its address written whole (a file seen between its creation and its write is empty)
            wait_until(lambda: rq_address.exists() and rq_address.read_text().startswith("redis://"),
                       "serve's Redis for RQ", 30)
            # the second model's processes share the cluster, and RQ's Redis for their batches
            env_b = {**env, "STRATA_REDIS_URL": cluster.url, "STRATA_RQ_REDIS_URL": rq_address.read_text(),
                     "STRATA_SERVED_MODEL_NAME": model_b, "STRATA_PORT": str(port_b)}
            started += [start("worker", env_b, *fake, "--parallel", "1"), start("api", env_b)]
            d = Deployment(cluster, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port_b}", model_b,
                           folder / "data", serve)
            for base, model in ((d.base, MODEL), (d.base_b, model_b)):
                wait_until(lambda b=base: healthy(b), "the API", 120)
                wait_until(lambda b=base, m=model: m in [x["id"] for x in httpx.get(f"{b}/v1/models").json()["data"]],
                           f"a worker of {model}", 60)
            yield d
        finally:
            codes = [stop(process, 60) for process in reversed(started)]
        assert codes[-1] == 0  # serve itself stopped cleanly on SIGTERM


def test_a_cluster_that_fails_to_form_leaves_no_node_running(tmp_path, monkeypatch):
    nodes: list[subprocess.Popen] = []

    def fails(cluster: Cluster) -> None:
        nodes.extend(cluster.processes)
        assert all(_answers(cluster, port) for port in cluster.ports)  # every node was up
        raise RuntimeError("CLUSTER MEET refused")

    monkeypatch.setattr(sys.modules[__name__], "form_cluster", fails)
    with pytest.raises(RuntimeError, match="CLUSTER MEET refused"):
        with running_cluster(tmp_path):
            pass
    assert len(nodes) == MASTERS and all(node.poll() is not None for node in nodes)
    assert processes.survivors((tmp_path,)) == {}


def chat(base: str, model: str, content: str, max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "seed": SEED, **extra})


def keys_on(cluster: Cluster, port: int, model: str) -> list[str]:
    with cluster.node(port) as node:
        return node.keys(f"strata:{{{model}}}:*")


def test_each_models_keys_live_on_one_node_and_two_models_on_two(deployment: Deployment):
    d = deployment
    answers = {}
    for base, model in ((d.base, MODEL), (d.base_b, d.model_b)):
        r = chat(base, model, "Say hello.")
        assert r.status_code == 200, r.text
        answers[model] = r.json()["choices"][0]["message"]["content"]
        rid = r.headers["x-request-id"]
        home = d.cluster.port_of_model(model)
        found = keys_on(d.cluster, home, model)
        assert {Keys(model).req(rid), Keys(model).out(rid), Keys(model).metrics, Keys(model).workers} <= set(found)
        assert all(keys_on(d.cluster, p, model) == [] for p in d.cluster.ports if p != home), model
    # the same fake weights and seed: the same answer, whichever node holds the queue
    assert answers[MODEL] == answers[d.model_b] and len(answers[MODEL].split()) == 8
    assert d.cluster.port_of_model(MODEL) != d.cluster.port_of_model(d.model_b)
    with d.client() as client:
        assert set(client.zrange(models_key(), 0, -1)) == {MODEL, d.model_b}


def test_a_stream_whose_worker_is_killed_resumes_on_the_restarted_worker(deployment: Deployment):
    d = deployment
    content, tokens = "Count slowly.", 60
    reference = chat(d.base, MODEL, content, tokens).json()["choices"][0]["message"]["content"]
    pid = d.worker_pid(MODEL)
    text, seen = [], 0
    with httpx.stream("POST", f"{d.base}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "seed": SEED, "stream": True}) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        for event in sse(r.iter_lines()):
            if event["data"] == "[DONE]":
                break
            for choice in json.loads(event["data"])["choices"]:
                text.append(choice["delta"].get("content") or "")
                seen += 1
            if seen == 10:
                os.kill(pid, signal.SIGKILL)  # mid-answer; serve restarts it, the new one takes the claim back
    assert "".join(text) == reference
    with d.client() as client:
        h = client.hgetall(Keys(MODEL).req(rid))
        entries = [f for _, f in client.xrange(Keys(MODEL).out(rid))]
    assert h["status"] == "finished" and h["attempts"] == "2" and h["claims_lost"] == "1"
    assert sum(len(e["ids"].split(",")) for e in entries if e["type"] == "token") == tokens  # each token once
    assert d.worker_pid(MODEL) != pid


def test_a_batch_runs_with_its_rq_jobs_beside_the_cluster(deployment: Deployment):
    d = deployment
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Batch line {i}."}],
                       "max_tokens": 5, "seed": SEED}} for i in range(3)]
    upload = httpx.post(f"{d.base}/v1/files", data={"purpose": "batch"}, timeout=30,
                        files={"file": ("in.jsonl", "\n".join(map(json.dumps, lines)).encode())})
    assert upload.status_code == 200, upload.text
    created = httpx.post(f"{d.base}/v1/batches", timeout=30, json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]

    def batch() -> dict:
        return httpx.get(f"{d.base}/v1/batches/{batch_id}", timeout=10).json()

    wait_until(lambda: batch()["status"] == "completed", "the batch", 120)
    assert batch()["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    out = httpx.get(f"{d.base}/v1/files/{batch()['output_file_id']}/content", timeout=10).text
    got = {row["custom_id"]: row["response"]["body"]["choices"][0]["message"]["content"]
           for row in map(json.loads, out.splitlines())}
    for line in lines:
        solo = chat(d.base, MODEL, line["body"]["messages"][0]["content"], 5).json()
        assert got[line["custom_id"]] == solo["choices"][0]["message"]["content"]
    # RQ's job hand-off went to the plain Redis serve started for it; none of RQ's keys in the cluster
    rq = redis.Redis.from_url((d.data / "rq" / "redis.url").read_text(), decode_responses=True)
    with rq:
        assert rq.keys("rq:job:*") and rq.sismember("rq:queues", "rq:queue:strata-batches")
    for port in d.cluster.ports:
        with d.cluster.node(port) as node:
            assert node.keys("rq:*") == []


def test_strata_queues_shows_both_models_from_the_cluster(deployment: Deployment):
    d = deployment
    # the second model has one slot: one long answer holds it, the next ones wait in service order
    ids = []
    for priority in (0, 1, 5, 3):
        r = chat(d.base_b, d.model_b, f"Wait {priority}.", 400, priority=priority, background=True)
        assert r.status_code == 202, r.text
        ids.append((priority, r.json()["id"]))
        if len(ids) == 1:
            wait_until(lambda: httpx.get(f"{d.base_b}/v1/requests/{ids[0][1]}").json()["status"] == "running",
                       "the first to run", 30)
    env = {**os.environ, "COLUMNS": "220"}
    env.pop("REDIS_URL", None)
    done = subprocess.run([sys.executable, "-m", "strata", "queues", "--redis-url", d.cluster.url],
                          capture_output=True, text=True, env=env, timeout=60)
    try:
        assert done.returncode == 0, done.stderr
        assert f"{d.model_b}: 3 waiting, 1 running" in done.stdout and f"{MODEL}: 0 waiting" in done.stdout
        order = [rid for line in done.stdout.splitlines() for _, rid in ids if f" {rid} " in line]
        assert order == [ids[2][1], ids[3][1], ids[1][1]]  # priority 5, 3, 1
        # a queue deadline on the cluster: the worker's sweep expires it (expire.lua)
        r = chat(d.base_b, d.model_b, "Too late.", 4, priority=9, background=True, queue_timeout=0.5)
        late = r.json()["id"]
        wait_until(lambda: httpx.get(f"{d.base_b}/v1/requests/{late}").json()["status"] == "expired", "expiry", 30)
    finally:
        for _, rid in ids:
            httpx.post(f"{d.base_b}/v1/requests/{rid}/cancel", timeout=10)
    wait_until(lambda: all(httpx.get(f"{d.base_b}/v1/requests/{rid}").json()["status"] == "cancelled"
                           for _, rid in ids), "every request cancelled", 30)
