"""The RQ worker running a batch dies (SIGKILL, the job with it) and a new one starts: the
batch resumes from where it was and every line is done exactly once."""

from __future__ import annotations

from collections import Counter

from queues.batches import request_id
from queues.keys import batch_key, batch_lease_key
from tests.helpers.batches import BatchWorkerProcess, chat_lines


def test_killed_batch_worker_resumes_every_line_exactly_once(start_stack):
    stack = start_stack(slots=2, step_s=0.01, batch_worker=False)
    first = BatchWorkerProcess(stack.redis_url, batch_inflight=6)
    second = None
    try:
        batch = stack.submit(chat_lines(40, max_tokens=5))
        seen = stack.wait(batch["id"], lambda b: b["request_counts"]["completed"] >= 8)
        first.kill()
        assert seen["status"] == "in_progress"
        killed_job = stack.redis.hget(batch_key(batch["id"]), "rq_job_id")
        # Lines fed before the kill go on running on the model's worker meanwhile.
        second = BatchWorkerProcess(stack.redis_url, batch_inflight=6)
        done = stack.wait_final(batch["id"], timeout_s=90)
    finally:
        first.kill()
        if second:
            second.stop()

    assert done["status"] == "completed", done
    # A new job finished it: the first died with its worker and did not carry on unseen.
    assert stack.redis.hget(batch_key(batch["id"]), "rq_job_id") != killed_job
    assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    output = stack.content(done["output_file_id"])
    assert Counter(e["custom_id"] for e in output) == Counter(f"q{i}" for i in range(40))
    assert int(stack.redis.get(stack.keys.claims)) == 40  # no line was queued or run twice
    assert all(stack.record(request_id(batch["id"], n))["attempts"] == "1" for n in range(40))
    assert not stack.redis.exists(batch_lease_key(batch["id"]))
