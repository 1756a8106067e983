"""The lines of a batch input file: checked and prepared when the batch is created, with the
endpoint's own rules (its schema, model check, tokenizing and max_tokens planning), so a line
is refused exactly as the endpoint would refuse its body."""

from __future__ import annotations

import json
from dataclasses import asdict

from pydantic import ValidationError

from queues.batches import request_id
from shapes.answers import ENDPOINTS
from shapes.errors import ApiError, validation_error
from shapes.rules import Rules
from shapes.text import unencodable_path

REQUIRED = ("custom_id", "method", "url", "body")


def file_error(message: str, code: str) -> ApiError:
    """A whole-file refusal: POST /v1/batches answers 400 and no batch is created."""
    return ApiError(400, message, code=code, param="input_file_id")


def parse_file(content: bytes, endpoint: str, max_lines: int) -> list[dict]:
    """The file's request lines, or a whole-file 400: not UTF-8 JSONL, a line that is not a
    JSON object, a missing custom_id/method/url/body, method not POST, url not the batch's
    endpoint, a custom_id that is not valid Unicode or used twice, no lines or more than
    max_lines. Blank lines are skipped. Bodies are checked per line by `prepare`."""
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
        except (json.JSONDecodeError, RecursionError) as error:
            why = error.msg if isinstance(error, json.JSONDecodeError) else "nested too deeply"
            raise file_error(f"Line {number} is not valid JSON: {why}.", "invalid_json_line") from None
        if not isinstance(line, dict):
            raise file_error(f"Line {number} is not a JSON object.", "invalid_json_line")
        missing = [field for field in REQUIRED if field not in line]
        if missing:
            raise file_error(f"Line {number} is missing {', '.join(missing)}.", "missing_required_parameter")
        if not isinstance(line["custom_id"], str) or unencodable_path(line["custom_id"]) is not None:
            raise file_error(f"Line {number}: custom_id must be a string of valid Unicode.", "invalid_custom_id")
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


def prepare(lines: list[dict], endpoint: str, rules: Rules, batch_id: str) -> list[str]:
    """Each line as stored in Redis: {"custom_id", "request"} ready to enqueue, or
    {"custom_id", "status_code", "error"} with what the endpoint would have answered.
    Blocking (tokenizes): call it in a thread."""
    schema = ENDPOINTS[endpoint].schema
    prepared = []
    for number, line in enumerate(lines):
        try:
            body = schema.model_validate(line["body"], from_attributes=True)  # FastAPI's wording
            rules.check(body)
            # The line's priority is the batch's, set when the job feeds it.
            prompt = rules.prompt(body)
            request = asdict(rules.queued(request_id(batch_id, number), body, prompt, priority=0))
            del request["id"], request["priority"]
            reading = rules.reading(body, prompt).fields()
            prepared.append(json.dumps({"custom_id": line["custom_id"], "request": request, "reading": reading}))
        except (ValidationError, ApiError) as caught:
            error = validation_error(caught.errors()) if isinstance(caught, ValidationError) else caught
            prepared.append(json.dumps({
                "custom_id": line["custom_id"], "status_code": error.status, "error": error.detail.model_dump(),
            }))
    return prepared
