"""A batch end to end: low priority that gives way to interactive traffic, every line once."""

from __future__ import annotations

import json
from collections import Counter

from queues.batches import request_id
from tests.helpers.batches import MODEL, chat_lines


def test_interactive_request_is_served_before_the_batch_lines_still_waiting(start_stack):
    stack = start_stack(slots=2, step_s=0.01, batch_inflight=8)
    batch = stack.submit(chat_lines(50, max_tokens=6))
    assert batch["status"] == "validating" and batch["priority"] == -10
    assert batch["request_counts"]["total"] == 50
    stack.wait(batch["id"], lambda b: b["request_counts"]["completed"] >= 6)

    answer = stack.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "urgent"}], "max_tokens": 3, "priority": 0})
    assert answer.status_code == 200, answer.text
    interactive = stack.record(answer.headers["x-request-id"])
    done = stack.wait_final(batch["id"])

    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 50, "completed": 50, "failed": 0}
    lines = [stack.record(request_id(batch["id"], n)) for n in range(50)]
    arrived = int(interactive["enqueued_ms"])
    # Every batch line that got a slot after the interactive request arrived got it after it.
    later = [r for r in lines if int(r["claimed_ms"]) > arrived]
    assert len(later) >= 10, "the batch had finished too early for the test to mean anything"
    assert all(int(r["claim_seq"]) > int(interactive["claim_seq"]) for r in later)
    # Some were already queued (fed by the job) when it arrived, and it still went first.
    queued_before = [r for r in later if int(r["enqueued_ms"]) < arrived]
    assert queued_before
    assert all(int(r["priority"]) == -10 for r in lines)

    output = stack.content(done["output_file_id"])
    assert Counter(e["custom_id"] for e in output) == Counter(f"q{i}" for i in range(50))
    first = next(e for e in output if e["custom_id"] == "q0")
    assert first["error"] is None and first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["message"]["content"].startswith(" t")
    assert done["error_file_id"] is None
    assert int(stack.redis.get(stack.keys.claims)) == 51  # each line claimed once, plus the interactive one


def test_cancel_stops_feeding_and_ends_cancelled(start_stack):
    stack = start_stack(slots=1, step_s=0.02, batch_inflight=3)
    batch = stack.submit(chat_lines(30, max_tokens=5))
    stack.wait(batch["id"], lambda b: b["request_counts"]["completed"] >= 3)
    cancelling = stack.http.post(f"/v1/batches/{batch['id']}/cancel").json()
    assert cancelling["status"] in ("cancelling", "cancelled") and cancelling["cancelling_at"]
    done = stack.wait_final(batch["id"])

    assert done["status"] == "cancelled" and done["cancelled_at"]
    counts = done["request_counts"]
    output = stack.content(done["output_file_id"])
    errors = stack.content(done["error_file_id"])
    assert counts["total"] == 30 and counts["failed"] == 0
    assert counts["completed"] == len(output) and 3 <= counts["completed"] < 30
    assert all(e["response"]["status_code"] == 200 for e in output)
    assert all(e["response"] is None and e["error"]["code"] == "batch_cancelled" for e in errors)
    assert sorted(e["custom_id"] for e in output + errors) == sorted(f"q{i}" for i in range(30))
    fed = [n for n in range(30) if stack.redis.exists(stack.keys.req(request_id(batch["id"], n)))]
    assert len(fed) <= counts["completed"] + 3  # at most the in-flight ones beyond those done
    assert stack.redis.zcard(stack.keys.waiting) == 0
    again = stack.http.post(f"/v1/batches/{batch['id']}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_completions_endpoint_and_list(start_stack):
    stack = start_stack(slots=2)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"say {i}", "max_tokens": 2}} for i in range(3)]
    batch = stack.submit(lines, endpoint="/v1/completions", priority=-3, metadata={"run": "nightly"})
    done = stack.wait_final(batch["id"])
    assert done["status"] == "completed" and done["priority"] == -3 and done["metadata"] == {"run": "nightly"}
    output = stack.content(done["output_file_id"])
    assert [e["custom_id"] for e in output] == ["c0", "c1", "c2"]
    assert output[0]["response"]["body"]["object"] == "text_completion"
    listed = stack.http.get("/v1/batches").json()
    assert listed["object"] == "list" and [b["id"] for b in listed["data"]] == [batch["id"]]
    out_file = stack.http.get(f"/v1/files/{done['output_file_id']}").json()
    assert out_file["purpose"] == "batch_output" and out_file["bytes"] > 0
    assert json.loads(stack.http.delete(f"/v1/files/{batch['input_file_id']}").text)["deleted"] is True
    assert stack.http.get(f"/v1/files/{batch['input_file_id']}").status_code == 404


def test_a_line_with_n_answers_gets_one_choice_per_answer(start_stack):
    stack = start_stack(slots=2, step_s=0.005, batch_inflight=2)
    lines = chat_lines(2, max_tokens=3)
    for line in lines:
        line["body"].update(n=2, seed=9)
    done = stack.wait_final(stack.submit(lines)["id"])
    assert done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}, done
    for entry in stack.content(done["output_file_id"]):
        body = entry["response"]["body"]
        choices = body["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert all(c["message"]["content"].count(" t") == 3 for c in choices)
        assert choices[0]["message"]["content"] != choices[1]["message"]["content"]  # seeds 9 and 10
        assert body["usage"]["completion_tokens"] == 6
