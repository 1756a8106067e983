"""`strata batch submit|status|cancel` against a real API."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.batches import chat_lines


def strata(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata", *args], capture_output=True, text=True, timeout=60)


def test_submit_writes_the_output_file_and_status_shows_it(start_stack, tmp_path):
    stack = start_stack(slots=2)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in chat_lines(4)))
    done = strata("batch", "submit", str(path), "--priority", "-5", "--poll-s", "0.1", "--api-url", stack.base_url)
    assert done.returncode == 0, done.stderr
    output = [json.loads(x) for x in (tmp_path / "in.output.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in output) == ["q0", "q1", "q2", "q3"]
    batch_id = done.stdout.split()[0]
    assert stack.batch(batch_id)["priority"] == -5
    status = strata("batch", "status", batch_id, "--api-url", stack.base_url)
    assert status.returncode == 0 and "completed" in status.stdout and "4 completed" in status.stdout
    cancel = strata("batch", "cancel", batch_id, "--api-url", stack.base_url)
    assert cancel.returncode == 1 and "invalid_state" in cancel.stderr
