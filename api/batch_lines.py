"""One line of a batch input file: checked and prepared when the batch is created (with the
endpoint's own rules: its schema, model check, tokenizing and max_tokens planning), and its
result worded as a line of the output or error file (OpenAI's format:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`)."""

from __future__ import annotations

import json
from dataclasses import asdict

from pydantic import ValidationError

from api import generation
from api.batch_schemas import ENDPOINTS
from api.deps import Services
from api.errors import ApiError, validation_error
from api.generation import Answer, Job
from api.routes.chat import ChatShape, chat_prompt
from api.routes.completions import CompletionShape, completion_prompt
from api.schemas import ChatCompletionRequest, CompletionRequest, ErrorBody, Usage
from queues.batches import request_id
from queues.records import Failed

REQUIRED = ("custom_id", "method", "url", "body")


def file_error(message: str, code: str) -> ApiError:
    """A whole-file refusal: POST /v1/batches answers 400 and no batch is created."""
    return ApiError(400, message, code=code, param="input_file_id")


def parse_file(content: bytes, endpoint: str, max_lines: int) -> list[dict]:
    """The file's request lines, or a whole-file 400: not UTF-8 JSONL, a line that is not a
    JSON object, a missing custom_id/method/url/body, method not POST, url not the batch's
    endpoint, a duplicate custom_id, no lines or more than max_lines. Blank lines are skipped."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise file_error("The input file is not UTF-8 text (JSONL expected).", "invalid_file_format") from None
    lines: list[dict] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if len(lines) >= max_lines:
            raise file_error(f"The input file has more than {max_lines} requests.", "too_many_requests")
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as error:
            raise file_error(f"Line {number} is not valid JSON: {error.msg}.", "invalid_json_line") from None
        if not isinstance(line, dict):
            raise file_error(f"Line {number} is not a JSON object.", "invalid_json_line")
        missing = [field for field in REQUIRED if field not in line]
        if missing:
            raise file_error(f"Line {number} is missing {', '.join(missing)}.", "missing_required_parameter")
        if not isinstance(line["custom_id"], str):
            raise file_error(f"Line {number}: custom_id must be a string.", "invalid_custom_id")
        if line["method"] != "POST":
            raise file_error(f"Line {number}: method must be POST.", "invalid_method")
        if line["url"] != endpoint:
            raise file_error(
                f"Line {number}: url {line['url']!r} is not this batch's endpoint {endpoint!r}.", "mismatched_url"
            )
        if line["custom_id"] in seen:
            raise file_error(f"Line {number}: custom_id {line['custom_id']!r} is used twice.", "duplicate_custom_id")
        seen.add(line["custom_id"])
        lines.append(line)
    if not lines:
        raise file_error("The input file holds no requests.", "empty_file")
    return lines


def prepare(lines: list[dict], endpoint: str, services: Services, batch_id: str) -> list[str]:
    """Each line as stored in Redis: {"custom_id", "request"} ready to enqueue, or
    {"custom_id", "status_code", "error"} with what the endpoint would have answered.
    Blocking (tokenizes): call it in a thread."""
    schema = ChatCompletionRequest if endpoint == ENDPOINTS[0] else CompletionRequest
    prepared = []
    for number, line in enumerate(lines):
        try:
            body = schema.model_validate(line["body"], from_attributes=True)  # FastAPI's wording
            generation.check_body(body, services)
            if isinstance(body, ChatCompletionRequest):
                prompt, param = chat_prompt(body, services.tokenizer), "messages"
            else:
                prompt, param = completion_prompt(body, services.tokenizer), "prompt"
            queued = generation.build_request(request_id(batch_id, number), body, prompt, services.settings, param)
            request = asdict(queued)
            del request["id"], request["priority"]  # the line's id and the batch's priority are set when fed
            prepared.append(json.dumps({"custom_id": line["custom_id"], "request": request}))
        except (ValidationError, ApiError) as caught:
            error = validation_error(caught.errors()) if isinstance(caught, ValidationError) else caught
            prepared.append(json.dumps({
                "custom_id": line["custom_id"], "status_code": error.status,
                "error": error.detail.model_dump(),
            }))
    return prepared


# ---- results: lines of the output and error files ------------------------------------------


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


def answer_body(endpoint: str, rid: str, model: str, created: int, text: str, finish_reason: str,
                prompt_tokens: int, completion_tokens: int) -> dict:
    """The body the endpoint answers for a whole (non-streamed) request."""
    shape = ChatShape() if endpoint == ENDPOINTS[0] else CompletionShape()
    job = Job(rid, created, model, 0, False)
    answer = Answer(text, finish_reason, Usage.of(prompt_tokens, completion_tokens))
    return shape.whole(job, answer).model_dump(mode="json")


def failure_body(event: Failed) -> tuple[int, dict]:
    """The status and error body the endpoint answers when the worker failed the request."""
    error = generation.failure(event)
    return error.status, ErrorBody(error=error.detail).model_dump()
