"""`strata serve`: one command that serves a real model. Starts Redis if none is given, then the
API and a worker as child processes; restarts a child that dies (the embedded Redis too); stops
all on Ctrl-C/SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from engine.devices import parse_devices
from queues.connect import is_cluster
from queues.server import EmbeddedRedis

log = logging.getLogger("strata.serve")

LISTEN_BACKLOG = 2048  # uvicorn's own default


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, pass_fds=self.pass_fds)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()


def child_env(settings, redis_url: str) -> dict[str, str]:  # noqa: ANN001 - a ServeCommand
    """The children read the same settings from STRATA_ variables."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"STRATA_{name.upper()}"] = json.dumps(value) if isinstance(value, list) else str(value)
    env["STRATA_REDIS_URL"] = redis_url
    return env


def listen(host: str, port: int) -> socket.socket:
    """The API's port, bound here once: every API replica accepts on this one socket (the kernel
    hands each connection to one of them), and it stays open while a replica restarts, so
    connections wait in its backlog instead of being refused or reset."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


def serve(settings) -> int:  # noqa: ANN001 - a ServeCommand
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    listener = listen(settings.host, settings.port)  # first: a port in use stops us before anything started
    redis_server = None
    url = settings.redis_url
    if not url:
        redis_server = EmbeddedRedis(settings.data_dir, appendfsync=settings.redis_fsync).start()
        url = redis_server.url
        log.info("embedded Redis at %s, data in %s", url, settings.data_dir.resolve())
    env = child_env(settings, url)
    rq_server = None
    if is_cluster(url, settings.redis_cluster) and not settings.rq_redis_url:
        # RQ cannot run on a cluster (batches/handoff.py rq_url): its job hand-off gets a plain
        # Redis of its own; the batches themselves stay in the cluster
        rq_server = EmbeddedRedis(settings.data_dir / "rq").start()
        env["STRATA_RQ_REDIS_URL"] = rq_server.url
        log.info("Redis Cluster at %s; RQ's jobs in an embedded Redis at %s", url, rq_server.url)
    python = sys.executable
    children = [
        Child(f"worker {device}", [python, "-m", "strata", "worker"], {**env, "STRATA_DEVICE": device})
        for device in parse_devices(settings.devices)
    ]
    fd = listener.fileno()
    children += [Child(f"api {n}" if settings.api_workers > 1 else "api", [python, "-m", "strata", "api"],
                       {**env, "STRATA_FD": str(fd)}, pass_fds=(fd,)) for n in range(settings.api_workers)]
    children.append(Child("batch-worker", [python, "-m", "strata", "batch-worker"], env))  # runs batches (RQ)
    try:
        for child in children:
            child.start()
        log.info("serving on http://%s:%d (Redis %s); Ctrl-C stops", settings.host, settings.port, url)
        while not stopping:
            time.sleep(0.2)
            for server in (redis_server, rq_server):
                if server and server.exited() and not stopping:
                    log.warning("embedded Redis exited; restarting it on the same port and data in %.1fs",
                                settings.restart_delay_s)
                    time.sleep(settings.restart_delay_s)
                    try:
                        server.start()  # same port, same append-only files: the queues come back
                    except RuntimeError:
                        log.exception("embedded Redis did not restart; trying again")
            for child in children:
                code = child.exited()
                if code is not None and not stopping:
                    log.warning("%s exited with %s; restarting in %.1fs", child.name, code, settings.restart_delay_s)
                    time.sleep(settings.restart_delay_s)
                    child.start()
    finally:
        for child in children:
            if child.process and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        for child in children:
            if child.process:
                try:
                    child.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
        listener.close()
        for server in (redis_server, rq_server):
            if server:
                server.stop()
        log.info("stopped")
    return 0
