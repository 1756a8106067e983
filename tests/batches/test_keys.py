"""A batch runs under its caller's API key: the key's maximum caps the batch's priority, the key's
models bind it, and each line's request hash names the key (never the key itself)."""

from __future__ import annotations

from tests.helpers.batches import chat_lines

KEYS = """
keys:
  - name: battery
    key: "sk-battery-5e1d"
    default_priority: -30
    max_priority: -20
  - name: elsewhere
    key: "sk-elsewhere-9a0b"
    models: [another-model]
"""


def test_a_batch_is_capped_and_named_by_its_key(start_stack, tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    stack = start_stack(api={"keys_file": str(path)})
    assert stack.upload(chat_lines(2)).status_code == 401
    stack.http.headers["Authorization"] = "Bearer sk-battery-5e1d"
    batch = stack.submit(chat_lines(3), priority=5)
    assert batch["priority"] == -20
    done = stack.wait_final(batch["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 3
    for line in range(3):
        record = stack.record(f"{batch['id']}-{line}")
        assert (record["priority"], record["key_name"]) == ("-20", "battery")
    stack.http.headers["Authorization"] = "Bearer sk-elsewhere-9a0b"
    uploaded = stack.upload(chat_lines(1)).json()
    refused = stack.create(uploaded["id"])
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
