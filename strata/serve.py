"""`strata serve`: one command that serves a real model. Starts Redis if none is given, then the
API and a worker as child processes; restarts a child that dies (the embedded Redis too), except
one that says its configuration cannot work (exit code 2: then all stop); prints a banner once it
answers (strata/startup.py); stops all on Ctrl-C/SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from engine.devices import parse_devices
from engine.files import resolve_model_path, served_model_name
from queues.connect import is_cluster
from queues.server import EmbeddedRedis
from strata.startup import FATAL_CONFIG, Banner, Readiness, client_url, listen

log = logging.getLogger("strata.serve")


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    process: subprocess.Popen | None = None

    def start(self) -> None:
        # its own process group: the terminal's Ctrl-C reaches serve alone, which stops every child
        # with SIGTERM; a SIGINT to a child mid-import could surface inside a library as another
        # error (pydantic_core wraps it in a SchemaError) and print a traceback
        self.process = subprocess.Popen(self.argv, env=self.env, pass_fds=self.pass_fds, process_group=0)

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


def worker_id(given: str | None, n: int, count: int) -> dict[str, str]:
    """A hand-set --worker-id names each of several workers apart (`<id>-<n>`): two workers of one
    id would renew and take back each other's claims."""
    if given is None or count == 1:
        return {}
    return {"STRATA_WORKER_ID": f"{given}-{n}"}


def serve(settings) -> int:  # noqa: ANN001 - a ServeCommand
    """Run until Ctrl-C/SIGTERM (0), or until a child exits with FATAL_CONFIG: then everything
    stops and so does serve, with that code (a worker that cannot load its model would fail the
    same way at every restart)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness probe (Readiness)
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: its terminal closed
        signal.signal(signum, stop)
    # before anything starts: a model that is not there, a port in use
    model_path = resolve_model_path(settings.model)
    model = settings.served_model_name or served_model_name(model_path)
    listener = listen(settings.host, settings.port)
    code = 0
    redis_server = rq_server = None
    children: list[Child] = []
    api = client_url(settings.host, settings.port)
    try:
        url = settings.redis_url
        if not url:
            redis_server = EmbeddedRedis(settings.data_dir, appendfsync=settings.redis_fsync).start()
            url = redis_server.url
            log.info("embedded Redis at %s, data in %s", url, settings.data_dir.resolve())
        env = child_env(settings, url)
        if is_cluster(url, settings.redis_cluster) and not settings.rq_redis_url:
            # RQ cannot run on a cluster (batches/handoff.py rq_url): its job hand-off gets a plain
            # Redis of its own; the batches themselves stay in the cluster
            rq_server = EmbeddedRedis(settings.data_dir / "rq").start()
            env["STRATA_RQ_REDIS_URL"] = rq_server.url
            log.info("Redis Cluster at %s; RQ's jobs in an embedded Redis at %s", url, rq_server.url)
        python = sys.executable
        devices = parse_devices(settings.devices)
        workers = [Child(f"worker {device}", [python, "-m", "strata", "worker"],
                         {**env, "STRATA_DEVICE": device, **worker_id(settings.worker_id, n, len(devices))})
                   for n, device in enumerate(devices)]
        fd = listener.fileno()
        children = [*workers, *(
            Child(f"api {n}" if settings.api_workers > 1 else "api", [python, "-m", "strata", "api"],
                  {**env, "STRATA_FD": str(fd)}, pass_fds=(fd,)) for n in range(settings.api_workers))]
        children.append(Child("batch-worker", [python, "-m", "strata", "batch-worker"], env))  # runs batches (RQ)
        for child in children:
            if not stopping:
                child.start()
        log.info("starting %s on %s; the API will be at %s (a banner says when it answers); Ctrl-C stops",
                 model, ", ".join(w.name.removeprefix("worker ") for w in workers), api)
        readiness: Readiness | None = Readiness(url, settings.redis_cluster, model, api)
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
                exited = child.exited()
                if exited is None or stopping:
                    continue
                if exited == FATAL_CONFIG:
                    log.error("%s cannot run with this configuration (its reason above); stopping everything",
                              child.name)
                    code, stopping = FATAL_CONFIG, True
                    break
                log.warning("%s exited with %s; restarting in %.1fs", child.name, exited, settings.restart_delay_s)
                time.sleep(settings.restart_delay_s)
                child.start()
            if readiness and not stopping:
                states = readiness.workers([w.process.pid for w in workers if w.process])
                if states is not None:
                    readiness.close()
                    readiness = None
                    print(Banner(model, model_path, settings.engine == "fake", states, api, url,
                                 settings.redis_cluster, None if settings.redis_url else settings.data_dir).text(),
                          flush=True)
        if readiness:
            readiness.close()
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
    return code
