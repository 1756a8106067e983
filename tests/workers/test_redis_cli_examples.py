"""The redis-cli examples of docs/running.md, run with the real redis-cli against a live queue."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path


from queues.keys import Keys
from tests.processes import system_binary
from tests.helpers.workers import MODEL, make_worker

RUNNING = Path(__file__).resolve().parents[2] / "docs" / "running.md"


def readme_commands() -> list[str]:
    block = RUNNING.read_text().split('R="redis-cli', 1)[1].split("```", 1)[0]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("$R ")]


def test_the_redis_cli_examples_show_the_live_queue(redis_url, redis_client, submit):
    redis_cli = system_binary("redis-cli", "redis-tools")
    submit("running-one", priority=1, max_tokens=100)
    worker = make_worker(redis_client, slots=1, worker_id="w-readme")
    worker.step()
    worker.upkeep.run(worker.clock(), worker.describe())
    for rid, priority in [("low", -5), ("alert", 9), ("normal", 0)]:
        submit(rid, priority=priority)
    base = Keys(MODEL).base
    outputs = {}
    commands = readme_commands()
    assert len(commands) >= 6
    for command in commands:
        command = (command.replace("chatcmpl-…", "running-one").replace("<wid>", "w-readme")
                   .replace("$M", base))
        argv = [redis_cli, "-u", redis_url] + shlex.split(command[len("$R "):])
        result = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
        outputs[" ".join(command.split()[1:3])] = result.stdout.split("\n")
    waiting = [line for line in outputs[f'ZRANGE "{base}:waiting"'] if ":" in line]
    assert [m.split(":")[1] for m in waiting][:3] == ["alert", "normal", "low"]  # service order
    assert outputs[f'ZCARD "{base}:waiting"'][0] == "3"
    request = outputs[f'HGETALL "{base}:req:running-one"']
    assert "running" in request and "w-readme" in request
    assert any(re.fullmatch(r"\d+-\d+", line) for line in outputs[f'XRANGE "{base}:out:running-one"'])
    assert "running-one" in outputs[f'ZRANGE "{base}:running"']
    assert f"{base}:worker:w-readme" in outputs["--scan --pattern"]
    assert "slots_busy" in outputs[f'HGETALL "{base}:worker:w-readme"']
