"""A line's result, worded as a line of the batch's output or error file (OpenAI's format:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`), with the
very body the endpoint answers for the same request."""

from __future__ import annotations

from queues.batches import request_id
from queues.records import Failed
from shapes import choices
from shapes.answers import ENDPOINTS, Answer, Job
from shapes.errors import failure
from shapes.parsing import Reading


def entry_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def response_entry(batch_id: str, line: int, custom_id: str, status_code: int, body: dict) -> dict:
    return {
        "id": entry_id(batch_id, line), "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id(batch_id, line), "body": body},
        "error": None,
    }


def unrun_entry(batch_id: str, line: int, custom_id: str, code: str, message: str) -> dict:
    """A line the batch never finished (cancelled or expired): no response, an error."""
    return {"id": entry_id(batch_id, line), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def answer_body(endpoint: str, rid: str, model: str, created: int, answers: list[Answer],
                reading: dict[str, str] | None = None) -> dict:
    """The body the endpoint answers for a whole (non-streamed) request: one choice per answer.
    reading: the line's `Job.record_fields` (tool calls and thinking split as the endpoint would)."""
    job = Job(rid, created, model, 0, False, Reading.of(reading or {}), len(answers))
    return choices.whole(ENDPOINTS[endpoint].shape, job, answers).model_dump(mode="json")


def failure_body(event: Failed) -> tuple[int, dict]:
    """The status and error body the endpoint answers when the worker failed the request."""
    error = failure(event)
    return error.status, error.body()
