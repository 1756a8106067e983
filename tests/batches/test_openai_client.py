"""The official openai client drives the whole flow."""

from __future__ import annotations

import json
import time

import openai

from tests.helpers.batches import chat_lines


def test_openai_client_files_and_batches(start_stack, tmp_path):
    stack = start_stack(slots=2)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in chat_lines(5)))
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")

    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == path.stat().st_size
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "smoke"}, extra_body={"priority": -20})
    assert batch.status == "validating" and batch.metadata == {"suite": "smoke"}
    deadline = time.monotonic() + 300  # a bound on a hang, not a speed: the machine may be loaded
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert batch.status == "completed"
    assert batch.request_counts.total == 5 and batch.request_counts.completed == 5
    assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
    assert [b.id for b in client.batches.list()] == [batch.id]

    lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == [f"q{i}" for i in range(5)]
    assert all(x["response"]["body"]["choices"][0]["message"]["content"] for x in lines)
    assert stack.record(lines[0]["response"]["request_id"])["priority"] == "-20"
    assert client.files.delete(uploaded.id).deleted
