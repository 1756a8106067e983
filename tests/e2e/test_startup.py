"""What `strata serve` and `strata worker` say at start, as real processes: the banner once serve
answers (its curl line asks, its redis-cli line shows the queue), and for each configuration that
cannot work (a port in use, a model path that is not there, an architecture the engine lacks, a
KV cache beyond the free memory) one line, exit code 2, no traceback, no restart loop and nothing
left running. Ctrl-C while the worker is still loading prints no traceback either."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from queues.keys import Keys
from queues.server import free_port
from queues.settings import environ_without_settings
from strata.startup import FATAL_CONFIG
from tests.e2e.conftest import MODEL, start, stop, wait_until
from tests.processes import session_members

# Far beyond any fault's few seconds of imports and reading a config: reaching it means a restart
# loop or a hang, not a slow machine.
EXIT_WITHIN_S = 240


@dataclass
class Run:
    process: subprocess.Popen
    stdout: Path
    stderr: Path

    def err(self) -> str:
        return self.stderr.read_text(errors="replace")

    def out(self) -> str:
        return self.stdout.read_text(errors="replace")


def run(tmp_path: Path, role: str, *flags: str, **env: str) -> Run:
    """`strata <role>` in a session of its own, its output in files, its environment free of this
    shell's STRATA_ settings."""
    out, err = tmp_path / f"{role}.out", tmp_path / f"{role}.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        process = start(role, {**environ_without_settings(), "STRATA_COMPILE": "0", **env}, *flags,
                        stdout=stdout, stderr=stderr)
    return Run(process, out, err)


def exits_fatally(r: Run, line: str | re.Pattern) -> None:
    """Exit code 2 with `line` (or a line matching it) on stderr, no traceback, nothing of its
    session left."""
    try:
        code = r.process.wait(EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        stop(r.process)
        raise AssertionError(f"still running after {EXIT_WITHIN_S}s:\n{r.err()[-3000:]}") from None
    err = r.err()
    assert code == FATAL_CONFIG, err[-3000:]
    pattern = line if isinstance(line, re.Pattern) else re.compile(re.escape(line))
    assert any(pattern.fullmatch(seen) for seen in err.splitlines()), err[-3000:]
    assert "Traceback" not in err, err
    assert session_members(r.process.pid) == []  # its Redis, workers and API stopped with it


def serve_flags(tmp_path: Path, *flags: str, port: int | None = None) -> list[str]:
    return ["--port", str(port or free_port()), "--data-dir", str(tmp_path / "data"), "--restart-delay-s", "0.2",
            *flags]


# the list of supported types grows with the engine: the line names them, whichever they are
UNSUPPORTED_GPT2 = re.compile(r"strata worker: unsupported model_type 'gpt2' \(supported: \[('[a-z0-9_]+'(, )?)+\]\)")


@pytest.fixture
def other_architecture(tiny_model: Path, tmp_path: Path) -> Path:
    """A model folder whose config names an architecture transformers knows and Strata does not."""
    folder = tmp_path / "gpt2-model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return folder


def test_serve_on_a_port_in_use_says_so_and_exits_2(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = run(tmp_path, "serve", *serve_flags(tmp_path, port=port))
        exits_fatally(r, f"strata serve: port {port} on 127.0.0.1 is in use (another strata serve?): "
                         "pick another with --port")
    assert not (tmp_path / "data" / "redis.url").exists()  # nothing was started


def test_the_api_alone_on_a_port_in_use_says_so_and_exits_2(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = run(tmp_path, "api", "--port", str(port), "--data-dir", str(tmp_path / "data"))
        exits_fatally(r, f"strata api: port {port} on 127.0.0.1 is in use (another strata serve?): "
                         "pick another with --port")


@pytest.mark.parametrize("role", ["serve", "worker"])
def test_a_model_path_that_does_not_exist_exits_2(tmp_path, role):
    missing = tmp_path / "no-such-model.gguf"
    flags = serve_flags(tmp_path) if role == "serve" else []
    r = run(tmp_path, role, "--model", str(missing), *flags)
    exits_fatally(r, f"strata {role}: model path does not exist: {missing}")


def test_serve_stops_when_its_worker_cannot_load_the_architecture(tmp_path, other_architecture):
    r = run(tmp_path, "serve", "--model", str(other_architecture), *serve_flags(tmp_path))
    exits_fatally(r, UNSUPPORTED_GPT2)
    err = r.err()
    assert "worker cpu cannot run with this configuration (its reason above); stopping everything" in err
    assert "restarting" not in err  # the worker was started once


def test_a_worker_alone_exits_2_on_an_architecture_it_lacks(tmp_path, other_architecture):
    r = run(tmp_path, "worker", "--model", str(other_architecture))
    exits_fatally(r, UNSUPPORTED_GPT2)


def test_serve_stops_when_the_kv_cache_cannot_fit_in_memory(tmp_path, tiny_model):
    r = run(tmp_path, "serve", "--model", str(tiny_model), "--parallel", "64", "--ctx", "100000000",
            *serve_flags(tmp_path))
    exits_fatally(r, re.compile(r"strata worker: the KV pool of 6400000000 tokens needs at least "
                                r"[0-9.]+ GiB, but cpu has [0-9.]+ GiB free: lower --kv-tokens "
                                r"\(default --parallel x --ctx\)"))


def test_the_banner_says_what_where_how_to_ask_and_where_the_queue_is(tmp_path):
    port = free_port()
    r = run(tmp_path, "serve", *serve_flags(tmp_path, "--engine", "fake", "--parallel", "1",
                                            "--fake-decode-ms-per-step", "20", port=port))
    try:
        wait_until(lambda: "Ctrl-C stops everything." in r.out(), "the banner", EXIT_WITHIN_S)
        banner = r.out()
        lines = {line.split()[0]: line.split(None, 1)[1] for line in banner.splitlines()
                 if line.startswith("  ") and line.split()}
        assert f"Strata is serving {MODEL}" in banner
        assert lines["workers"] == "cpu: 1 slot of 2048 tokens"
        assert lines["API"].startswith(f"http://127.0.0.1:{port}/v1 ")
        # the curl line, as a shell would split it, asks and is answered
        curl = shlex.split(lines["ask"])
        assert curl[:2] == ["curl", "-s"] and curl[2] == f"http://127.0.0.1:{port}/v1/chat/completions"
        asked = httpx.post(curl[2], json=json.loads(curl[curl.index("-d") + 1]), timeout=60)
        assert asked.status_code == 200 and asked.json()["model"] == MODEL, asked.text
        # the redis-cli line names serve's Redis and the model's queue: a request waiting behind
        # a long one is there
        cli = shlex.split(lines["queue"])
        assert cli[:2] == ["redis-cli", "-u"] and cli[3:] == ["ZRANGE", Keys(MODEL).waiting, "0", "-1", "WITHSCORES"]
        assert cli[2] == (tmp_path / "data" / "redis.url").read_text()
        ids = [chat_in_background(port, tokens) for tokens in (2000, 4)]
        with redis.Redis.from_url(cli[2], decode_responses=True) as client:
            wait_until(lambda: [m.partition(":")[2] for m in client.zrange(cli[4], 0, -1)] == ids[1:], "the waiting one")
        for rid in ids:
            httpx.post(f"http://127.0.0.1:{port}/v1/requests/{rid}/cancel", timeout=10)
        assert "strata queues --data-dir" in banner
    finally:
        assert stop(r.process, 60) == 0


def test_the_banner_comes_with_hand_set_worker_ids_each_worker_its_own(tmp_path):
    r = run(tmp_path, "serve", *serve_flags(tmp_path, "--engine", "fake", "--parallel", "1", "--devices", "cpu,cpu",
                                            "--worker-id", "by-hand"))
    try:
        wait_until(lambda: "Ctrl-C stops everything." in r.out(), "the banner", EXIT_WITHIN_S)
        workers = [line.split()[-6:] for line in r.out().splitlines() if "slot of" in line]
        assert workers == [["cpu:", "1", "slot", "of", "2048", "tokens"]] * 2
        with redis.Redis.from_url((tmp_path / "data" / "redis.url").read_text(), decode_responses=True) as client:
            assert sorted(client.zrange(Keys(MODEL).workers, 0, -1)) == ["by-hand-0", "by-hand-1"]
    finally:
        assert stop(r.process, 60) == 0


def chat_in_background(port: int, max_tokens: int) -> str:
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Wait."}], "max_tokens": max_tokens,
        "background": True, "ignore_eos": True})
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


@pytest.mark.smollm2
def test_ctrl_c_while_the_worker_loads_prints_no_traceback(tmp_path):
    """A fresh data folder and the defaults (the compiled step included): the terminal's Ctrl-C
    (SIGINT to the whole foreground process group: serve, its workers, API and batch worker) as
    soon as the worker starts loading."""
    r = run(tmp_path, "serve", *serve_flags(tmp_path), STRATA_COMPILE="1")
    try:
        wait_until(lambda: " INFO loading " in r.err(), "the worker loading", EXIT_WITHIN_S)
        os.killpg(r.process.pid, signal.SIGINT)
        code = r.process.wait(120)
    finally:
        stop(r.process)
    err = r.err()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert session_members(r.process.pid) == []
    assert err.splitlines()[-1].endswith(" strata.serve INFO stopped")


def test_a_bad_flag_value_is_one_line_and_exit_2(tmp_path):
    r = run(tmp_path, "worker", "--parallel", "0")
    exits_fatally(r, "strata worker: invalid configuration: parallel: Input should be greater than or equal to 1")
