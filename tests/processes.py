"""The processes tests start, and the system programs some tests need.

Every command a test starts runs in a session of its own (`spawn`), so stopping it (`stop`)
stops all it started too (serve's Redis, workers, API replicas, their compile helpers), even when
the command itself was killed or hangs. Every process started during a run carries RUN_MARK in
its environment (tests/conftest.py sets it), and servers work in a test's temporary folder, so
the end of the run finds any that survived (`survivors`), whoever started it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

# Not STRATA_-prefixed: the helpers that strip Strata's settings from a child's environment
# (queues.settings.environ_without_settings) keep it.
RUN_MARK = "PYTEST_STRATA_RUN"
CI_MARK = "STRATA_CI"  # set by .ci/run: a test that needs a program CI installs fails when it is missing

# Helpers of the test process itself that outlive a test by design and end with it.
_OWN_HELPERS = ("multiprocessing", "torch/_inductor/compile_worker")


def spawn(argv: list[str], **popen: object) -> subprocess.Popen:
    """Start `argv` as the leader of a new session (and process group)."""
    return subprocess.Popen(argv, start_new_session=True, **popen)  # type: ignore[call-overload]


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`: what a spawned command and its children left."""
    members = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        pid = int(entry)
        try:
            if os.getsid(pid) == sid and _state(pid) != "Z":
                members.append(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return members


def stop(process: subprocess.Popen, timeout_s: float = 30) -> int | None:
    """Stop a spawned command: SIGTERM (its own clean shutdown), then SIGKILL to every process of
    its session still there after timeout_s. The leader's exit code, None if it had to be killed."""
    code = process.poll()
    if code is None:
        process.terminate()
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill(session_members(process.pid))
            process.wait()
            return None
    left = session_members(process.pid)  # what outlived the leader: asked once, politely
    for pid in left:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = session_members(process.pid)
    kill(left)
    return code


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def survivors(folders: tuple[Path, ...] = (), grace_s: float = 0) -> dict[int, str]:
    """Processes of this run other than the test process and its own helpers, by pid with their
    command lines: those with RUN_MARK in their environment, or working in one of `folders` (a
    Redis server overwrites its environment with its title, but works in the --dir it was given,
    a test's temporary folder). Waits up to grace_s for them to go."""
    mark = f"{RUN_MARK}={os.environ[RUN_MARK]}".encode()
    roots = [str(folder.resolve()) for folder in folders]
    deadline = time.monotonic() + grace_s
    while True:
        found = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            pid = int(entry)
            if pid == os.getpid():
                continue
            try:
                marked = mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cwd = os.readlink(f"/proc/{pid}/cwd").removesuffix(" (deleted)")
                inside = any(cwd == root or cwd.startswith(root + os.sep) for root in roots)
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if (marked or inside) and _state(pid) != "Z" and not _own_helper(pid, command):
                    found[pid] = command.strip()
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def _own_helper(pid: int, command: str) -> bool:
    return _parent(pid) == os.getpid() and any(helper in command for helper in _OWN_HELPERS)


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _state(pid: int) -> str:
    return _stat(pid)[0]


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def system_binary(name: str, package: str) -> str:
    """The path of a program that is not Python's to install (a Debian package). Missing, the
    test is skipped with what to install; in CI (.ci/run sets STRATA_CI=1, and installs it) a
    missing program fails the test instead, so CI never passes by skipping."""
    found = shutil.which(name)
    if found:
        return found
    why = f"`{name}` is not installed (apt-get install {package}; .ci/run installs it)"
    if os.environ.get(CI_MARK) == "1":
        pytest.fail(f"{why}, and {CI_MARK}=1: CI must run this test", pytrace=False)
    pytest.skip(why)
