"""The guards of tests/processes.py: what a test starts is stopped with everything it started,
a survivor is found, and a missing system program skips here but fails in CI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import redis

from queues.server import free_port, server_binary
from tests import processes
from tests.e2e.conftest import wait_until

# A leader that starts a Redis server as its own child, says its pid, and waits to be stopped.
PARENT_OF_A_SERVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.argv[1], "--port", sys.argv[2], "--save", "", "--appendonly", "no"],
                         stdout=subprocess.DEVNULL)
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return processes._state(pid) != "Z"
    except FileNotFoundError:
        return False


def test_stop_ends_the_server_a_killed_leader_left_behind():
    leader = processes.spawn([sys.executable, "-c", PARENT_OF_A_SERVER, server_binary(), str(free_port())],
                             stdout=subprocess.PIPE, text=True)
    try:
        server = int(leader.stdout.readline())
        assert alive(server) and os.getsid(server) == leader.pid
        os.kill(leader.pid, signal.SIGKILL)  # the leader dies without stopping its child
        assert leader.wait(10) == -signal.SIGKILL
        assert alive(server)  # orphaned, still running
        assert processes.stop(leader, 10) == -signal.SIGKILL
        assert not alive(server) and processes.session_members(leader.pid) == []
    finally:
        processes.kill(processes.session_members(leader.pid))
        leader.stdout.close()


def test_the_end_of_run_check_sees_a_running_server_and_not_a_stopped_one(tmp_path):
    port = free_port()
    server = processes.spawn([server_binary(), "--port", str(port), "--save", "", "--appendonly", "no",
                              "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        wait_until(lambda: answers(client), "the server")  # started: it has retitled itself by now
        client.close()
        assert server.pid in processes.survivors((tmp_path,))  # by the folder it works in
        assert server.pid not in processes.survivors()  # its environment has no mark left
    finally:
        assert processes.stop(server, 10) == 0  # SIGTERM: a server's clean shutdown
    assert server.pid not in processes.survivors((tmp_path,))


def answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False


def test_a_missing_system_program_skips_saying_what_to_install(monkeypatch):
    monkeypatch.delenv(processes.CI_MARK, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"apt-get install no-such-package"):
        processes.system_binary("no-such-program-here", "no-such-package")


def test_a_missing_system_program_fails_in_ci(monkeypatch):
    monkeypatch.setenv(processes.CI_MARK, "1")
    with pytest.raises(pytest.fail.Exception, match=r"apt-get install no-such-package.*STRATA_CI=1"):
        processes.system_binary("no-such-program-here", "no-such-package")
    assert processes.system_binary("sh", "dash").endswith("/sh")  # a present one is found either way
