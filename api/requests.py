"""Requests that outlive their connection: look one up by id, re-attach to its output stream,
cancel it. Everything needed is in Redis (the request hash and its output stream), so any API
replica answers, through an API restart, until --retention-s after the request ended.

A request is only visible to the key that made it: another key's id is answered 404 exactly as
an unknown one, so nobody learns whether it exists."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from fastapi.sse import EventSourceResponse, format_sse_event

from api.api_keys import ApiKey
from api.completions import assemble, stream_events
from api.deps import Services
from queues.lifecycle import FINAL
from shapes import choices
from shapes.choices import Choices
from shapes.answers import ENDPOINTS, Endpoint, Job
from shapes.errors import ApiError
from shapes.parsing import Reading
from shapes.responses import RequestObject

_ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")


async def find(services: Services, request_id: str, key: ApiKey | None) -> tuple[dict[str, str], Endpoint]:
    """The request's hash and the endpoint that accepted it; 404 when unknown, expired, another
    key's, or not made through a generation endpoint (a batch line: its batch reports it)."""
    record = await services.intake.record(request_id)
    if (record is None or record.get("endpoint") not in ENDPOINTS
            or (key is not None and record.get("key_name") != key.name)):
        raise ApiError(404, f"No request '{request_id}': unknown, ended more than the retention time ago, "
                       "or made with another key.", code="request_not_found", param="request_id")
    return record, ENDPOINTS[record["endpoint"]]


def job_of(services: Services, record: dict[str, str]) -> Job:
    """The request as its answer refers to it: the same id, created and usage choice as first sent."""
    return Job(record["id"], int(record["created"]), services.model_name, int(record["priority"]),
               record.get("include_usage") == "1", Reading.of(record), int(record.get("n") or 1))


async def lookup(services: Services, request_id: str, key: ApiKey | None) -> RequestObject:
    record, endpoint = await find(services, request_id, key)
    found = RequestObject(id=request_id, endpoint=endpoint.path, model=services.model_name,
                          created=int(record["created"]), priority=int(record["priority"]), status=record["status"])
    if found.status in FINAL:  # RequestStatus is a str enum: its values are members
        job = job_of(services, record)
        try:
            answers = assemble(Choices(job.n), (event for _entry_id, event in await services.intake.events(request_id)))
        except ApiError as error:
            found.error = error.detail.model_dump()
        else:
            if answers is not None:
                found.response = choices.whole(endpoint.shape, job, answers)
    return found


async def reattach(request: Request, services: Services, request_id: str, key: ApiKey | None,
                   after: str | None) -> Response:
    """The output after entry `after` (None: from the start), then live until [DONE], framed as
    the original endpoint framed it. Only a reader: leaving cancels nothing."""
    record, endpoint = await find(services, request_id, key)
    after = after.strip() if after else "0-0"
    if not _ENTRY_ID.fullmatch(after):
        raise ApiError(400, f"'{after}' is not an event id of this stream (they look like 1733000000000-0).",
                       code="invalid_event_id", param="Last-Event-ID")
    headers = {"x-request-id": request_id, "x-strata-priority": record["priority"]}
    if record["status"] in FINAL and not await services.intake.events(request_id, after, count=1):
        # the client already has the end event: all that is left to say is [DONE]
        return EventSourceResponse(_done_only(), headers=headers)
    events = stream_events(request, services, job_of(services, record), endpoint.shape,
                           cancel_on_leave=False, after=after)
    return EventSourceResponse(events, headers=headers)


async def cancel(services: Services, request_id: str, key: ApiKey | None) -> RequestObject:
    """A waiting request ends at once (cancelled); a running one at its worker's next step."""
    await find(services, request_id, key)
    await services.intake.cancel(request_id)
    return await lookup(services, request_id, key)


async def _done_only() -> AsyncIterator[bytes]:
    yield format_sse_event(data_str="[DONE]")
