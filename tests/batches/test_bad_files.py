"""Bad input files: a 400 for the whole file (no batch is created), or a per-line error entry
with what the endpoint itself answers for that body."""

from __future__ import annotations

import json

import pytest

from tests.helpers.batches import MODEL, chat_lines

GOOD = chat_lines(1)[0]


def line(**changes: object) -> str:
    data = {**GOOD, **changes}
    return json.dumps({k: v for k, v in data.items() if v is not None})


@pytest.mark.parametrize(("content", "code"), [
    (line() + "\n{not json\n", "invalid_json_line"),
    (line() + "\n[1, 2]\n", "invalid_json_line"),
    (line(custom_id=None) + "\n", "missing_required_parameter"),
    (line(body=None) + "\n", "missing_required_parameter"),
    (line(method=None) + "\n", "missing_required_parameter"),
    (line(url="/v1/completions") + "\n", "mismatched_url"),
    (line(method="GET") + "\n", "invalid_method"),
    (line() + "\n" + line() + "\n", "duplicate_custom_id"),
    ("\n\n", "empty_file"),
    (b"\xff\xfe" + line().encode(), "invalid_file_format"),
    ("".join(line(custom_id=f"x{i}") + "\n" for i in range(4)), "too_many_requests"),
])
def test_whole_file_refused_with_400(start_stack, content, code):
    stack = start_stack(worker=False, batch_worker=False, api=dict(batch_max_lines=3))
    uploaded = stack.upload(content if isinstance(content, bytes) else content.encode())
    assert uploaded.status_code == 200
    created = stack.create(uploaded.json()["id"])
    assert created.status_code == 400, created.text
    error = created.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["param"] == "input_file_id"
    assert stack.http.get("/v1/batches").json()["data"] == []


def test_too_large_file_refused_at_upload(start_stack):
    stack = start_stack(worker=False, batch_worker=False, api=dict(batch_max_file_bytes=1000))
    response = stack.upload(("".join(line(custom_id=f"x{i}") + "\n" for i in range(20))).encode())
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "file_too_large"


def test_bad_requests_to_create(start_stack):
    stack = start_stack(worker=False, batch_worker=False)
    file_id = stack.upload([GOOD]).json()["id"]
    assert stack.create(file_id, endpoint="/v1/embeddings").json()["error"]["param"] == "endpoint"
    assert stack.create("file-nope").status_code == 404
    wrong_window = stack.http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                        "completion_window": "1h"})
    assert wrong_window.status_code == 400 and wrong_window.json()["error"]["param"] == "completion_window"
    missing = stack.http.post("/v1/batches", json={"endpoint": "/v1/completions"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input_file_id"
    purpose = stack.http.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "fine-tune"})
    assert purpose.status_code == 400 and purpose.json()["error"]["param"] == "purpose"


BAD_BODIES = {
    "no-messages": {"model": MODEL, "max_tokens": 2},
    "hot": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 5},
    "huge-seed": {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64},
    "surrogate": {"messages": [{"role": "user", "content": "\ud800"}]},
    "tiny-top-p": {"messages": [{"role": "user", "content": "hi"}], "top_p": 1e-300},
    "wrong-model": {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
    "n17": {"messages": [{"role": "user", "content": "hi"}], "n": 17},
    "too-long": {"messages": [{"role": "user", "content": "x" * 600}]},
    "not-an-object": "hello",
}


def test_bad_line_bodies_get_the_endpoints_error_in_the_error_file(start_stack):
    stack = start_stack(slots=2)
    lines = chat_lines(2) + [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions", "body": body}
                             for name, body in BAD_BODIES.items()]
    batch = stack.submit(lines)
    done = stack.wait_final(batch["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 2 + len(BAD_BODIES), "completed": 2, "failed": len(BAD_BODIES)}
    assert sorted(e["custom_id"] for e in stack.content(done["output_file_id"])) == ["q0", "q1"]
    errors = {e["custom_id"]: e for e in stack.content(done["error_file_id"])}
    assert set(errors) == set(BAD_BODIES)
    for name, body in BAD_BODIES.items():
        direct = stack.http.post("/v1/chat/completions", content=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
        assert errors[name]["response"]["status_code"] == direct.status_code, name
        assert errors[name]["response"]["body"] == direct.json(), name
        assert errors[name]["error"] is None


def test_a_huge_seed_is_refused_as_a_request_and_as_a_line_and_the_worker_serves_on(start_stack):
    stack = start_stack(slots=1)
    huge = {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64, "max_tokens": 3}
    refused = stack.http.post("/v1/chat/completions", json=huge)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "seed" and refused.json()["error"]["code"] == "invalid_value"
    assert stack.redis.zcard(stack.keys.waiting) == 0  # it never reached the queue

    lines = [{"custom_id": "huge", "method": "POST", "url": "/v1/chat/completions", "body": huge}] + chat_lines(1)
    done = stack.wait_final(stack.submit(lines)["id"])
    assert (done["status"], done["request_counts"]) == ("completed", {"total": 2, "completed": 1, "failed": 1})
    [error] = stack.content(done["error_file_id"])
    assert error["custom_id"] == "huge" and error["response"]["status_code"] == 400
    assert error["response"]["body"] == refused.json()
    assert [e["custom_id"] for e in stack.content(done["output_file_id"])] == ["q0"]

    answered = stack.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "seed": 2**64 - 1, "max_tokens": 3, "ignore_eos": True})
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["completion_tokens"] == 3
