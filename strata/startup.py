"""What `strata` says at start. Once `strata serve` answers, a banner: what it serves (model,
file, each worker's device and slots), where (the API's URL), how to ask (a curl line) and where
its queue is in Redis (a redis-cli line). For a configuration that cannot work, one line and exit
code FATAL_CONFIG, which `strata serve` reads in a child as "do not restart it"."""

from __future__ import annotations

import errno
import json
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import httpx

from engine.errors import ConfigError
from queues.connect import cluster_nodes, connect, is_cluster
from queues.inspect import model_view
from queues.keys import Keys
from queues.worker_state import WorkerState

FATAL_CONFIG = 2  # exit code: the configuration cannot work here; starting again changes nothing
LISTEN_BACKLOG = 2048  # uvicorn's own default


def fail(command: str, message: str) -> NoReturn:
    """One line on stderr, `strata <command>: <message>`, and exit code FATAL_CONFIG."""
    print(f"strata {command}: {message}".rstrip(), file=sys.stderr, flush=True)
    sys.exit(FATAL_CONFIG)


def listen(host: str, port: int) -> socket.socket:
    """The API's port, bound before anything else starts. `strata serve` binds it once and every
    API replica accepts on this one socket (the kernel hands each connection to one of them); it
    stays open while a replica restarts, so connections wait in its backlog instead of being
    refused. `strata api` alone binds it the same way. In use: a ConfigError (one line, exit 2)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is in use (another strata serve?): pick another with --port") \
                from None
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def client_url(host: str, port: int) -> str:
    """The API's base URL as a client on this machine types it (a wildcard bind answers on loopback)."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class Banner:
    model: str  # the name clients send
    path: Path  # the weights it names
    fake: bool  # --engine fake: nothing of the file is loaded
    workers: list[WorkerState]
    api: str  # client_url
    redis_url: str
    cluster: bool
    data_dir: Path | None  # the embedded Redis's folder (None: the operator's own Redis)

    def text(self) -> str:
        what = f"{self.path}" + ("  (fake engine: no weights loaded)" if self.fake else "")
        workers = [f"{w.device}: {w.slots_total} slot{'s' if w.slots_total != 1 else ''} of {w.ctx} tokens"
                   for w in self.workers]
        queues = (f"strata queues --data-dir {shlex.quote(str(self.data_dir))}" if self.data_dir
                  else f"strata queues --redis-url {shlex.quote(self.redis_url)}")
        lines = [
            f"Strata is serving {self.model}",
            f"  model    {what}",
            *(f"  {'workers' if i == 0 else '':8} {w}" for i, w in enumerate(workers)),
            f"  API      {self.api}/v1 (OpenAI-compatible; {self.api}/health, {self.api}/metrics)",
            f"  ask      {self.curl()}",
            f"  queue    {self.redis_cli()}",
            f"           or: {queues}",
            "Ctrl-C stops everything.",
        ]
        return "\n".join(lines)

    def curl(self) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Say hello."}], "priority": 0,
                "max_tokens": 32}
        return (f"curl -s {self.api}/v1/chat/completions -H 'content-type: application/json' "
                f"-d {shlex.quote(json.dumps(body))}")

    def redis_cli(self) -> str:
        """The queue in service order, as `redis-cli` lists it."""
        key = shlex.quote(Keys(self.model).waiting)
        if is_cluster(self.redis_url, self.cluster):
            first, _nodes = cluster_nodes(self.redis_url)
            return f"redis-cli -c -u {shlex.quote(first)} ZRANGE {key} 0 -1 WITHSCORES"
        return f"redis-cli -u {shlex.quote(self.redis_url)} ZRANGE {key} 0 -1 WITHSCORES"


class Readiness:
    """Whether a starting `strata serve` answers yet: each of its workers (known by the pid it
    publishes, whatever its id: --worker-id may set one by hand) has published its slots in Redis, and then its API says it is healthy. The
    API is asked at most every HEALTH_EVERY_S (each ask is a line of its access log)."""

    HEALTH_EVERY_S = 1.0

    def __init__(self, redis_url: str, cluster: bool, model: str, api: str) -> None:
        self.redis_url, self.cluster, self.model, self.api = redis_url, cluster, model, api
        self.client = None
        self.asked_at = -self.HEALTH_EVERY_S

    def workers(self, pids: list[int]) -> list[WorkerState] | None:
        """The workers' published states, in the order of `pids`, once all are up; else None."""
        try:
            if self.client is None:
                self.client = connect(self.redis_url, cluster=self.cluster, within_s=0)
            view = model_view(self.client, self.model, int(time.time() * 1000), limit=1)
        except Exception:  # noqa: BLE001 - a Redis not up yet is simply "not yet"
            return None
        found = {state.pid: state for _wid, state in view.workers if state.pid in pids}
        if len(found) < len(pids) or not self._healthy():
            return None
        return [found[pid] for pid in pids]

    def _healthy(self) -> bool:
        now = time.monotonic()
        if now - self.asked_at < self.HEALTH_EVERY_S:
            return False
        self.asked_at = now
        try:
            return httpx.get(f"{self.api}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
