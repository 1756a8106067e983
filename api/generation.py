"""What chat and text completions share: turn a validated body into a queued request, enqueue
it, then read the worker's output back and answer whole or as a stream of SSE events.

Each endpoint only says how its answer is worded (a `Shape`). Whatever way a handler ends
before the answer's last event (client gone, handler cancelled, Redis error) the request is
cancelled in Redis, so a worker never spends a slot on an answer nobody reads."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import KEEPALIVE_COMMENT, EventSourceResponse, format_sse_event
from pydantic import BaseModel

from api.deps import Services
from api.errors import ApiError
from api.keys import ApiKey
from api.priority import Resolved, resolve_priority
from api.schemas import ErrorBody, GenerationBody, Usage
from api.settings import ApiSettings
from queues.connect import UNAVAILABLE
from queues.intake import Intake
from queues.records import Done, Event, Failed, QueuedRequest, Token
from queues.scripts import QueueError, QueueRefused

log = logging.getLogger("strata.api")

KEEPALIVE_S = 15.0
OUTAGE_POLL_S = 0.5  # how often a stream looks for Redis again while it is away
_UNAVAILABLE_CODES = {"cancelled", "worker_lost", "unavailable", "expired"}


@dataclass(frozen=True)
class Job:
    """One accepted request, as its answer refers to it."""

    id: str
    created: int
    model: str
    priority: int
    include_usage: bool


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    usage: Usage


class Shape(Protocol):
    """How one endpoint words its answer."""

    def opening(self, job: Job) -> BaseModel | None: ...
    def chunk(self, job: Job, text: str | None, finish_reason: str | None) -> BaseModel: ...
    def usage_chunk(self, job: Job, usage: Usage) -> BaseModel: ...
    def whole(self, job: Job, answer: Answer) -> BaseModel: ...


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_body(body: GenerationBody, services: Services, key: ApiKey | None = None) -> None:
    """The checks that come before tokenizing: the model asked for (and whether the caller's key
    may use it), and n."""
    if body.model and body.model != services.model_name:
        raise ApiError(
            404, f"The model '{body.model}' does not exist; this server serves '{services.model_name}'.",
            code="model_not_found", param="model",
        )
    check_key_may_use(services, key)
    if body.n != 1:
        raise ApiError(400, "Only n=1 is supported.", code="unsupported_value", param="n")


def check_key_may_use(services: Services, key: ApiKey | None) -> None:
    """A key restricted to other models sees this one as not existing (404, as OpenAI does)."""
    if key is not None and not key.allows(services.model_name):
        raise ApiError(404, f"The model '{services.model_name}' does not exist or this key may not use it.",
                       code="model_not_found", param="model")


def plan_max_tokens(prompt_len: int, requested: int | None, settings: ApiSettings, param: str) -> int:
    """The answer length: what was asked (default_max_tokens when nothing was), lowered so that
    prompt + answer fit in one slot of `ctx` tokens. A prompt that leaves no room is refused."""
    room = settings.ctx - prompt_len
    if room <= 0:
        raise ApiError(
            400,
            f"This model's context is {settings.ctx} tokens; the prompt has {prompt_len}, "
            f"which leaves no room for an answer.",
            code="context_length_exceeded", param=param,
        )
    wanted = settings.default_max_tokens if requested is None else requested
    return min(wanted, room)


def priority_of(body: GenerationBody, settings: ApiSettings, key: ApiKey | None = None) -> Resolved:
    """Rule 1, with the caller's key's default and maximum (api/priority.py)."""
    return resolve_priority(body.priority, settings.priority_min, settings.priority_max, key)


def build_request(
    request_id: str, body: GenerationBody, prompt: list[int], settings: ApiSettings, param: str,
    key: ApiKey | None = None,
) -> QueuedRequest:
    max_tokens = plan_max_tokens(len(prompt), body.requested_max_tokens(), settings, param)
    return QueuedRequest(
        id=request_id,
        priority=priority_of(body, settings, key).value,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        seed=body.seed,
        min_tokens=min(body.min_tokens, max_tokens),
        ignore_eos=body.ignore_eos,
        stop=body.stop_list(),
    )


async def answer(
    request: Request, services: Services, queued: QueuedRequest, shape: Shape, body: GenerationBody,
    key: ApiKey | None = None,
) -> Response:
    """Enqueue, then answer whole or stream: the one path both endpoints take."""
    settings = services.settings
    await enqueue(services.intake, queued, settings, key)
    job = Job(queued.id, int(time.time()), services.model_name, queued.priority, body.include_usage)
    headers = {"x-request-id": queued.id, "x-strata-priority": str(queued.priority)}
    priority = priority_of(body, settings, key)
    if priority.lowered:  # the key's maximum lowered it: say so (asked->used)
        headers["x-strata-priority-lowered"] = f"{priority.asked}->{priority.value}"
    if body.stream:
        events = stream_events(request, services, job, shape)
        # Start the generator now: from here on, however the response ends, its guard cancels.
        first = await anext(events)
        return EventSourceResponse(_prepend(first, events), headers=headers)
    result = await collect(request, services, queued.id)
    return JSONResponse(shape.whole(job, result).model_dump(mode="json"), headers=headers)


async def enqueue(intake: Intake, queued: QueuedRequest, settings: ApiSettings, key: ApiKey | None = None) -> int:
    """Only the key's name goes to Redis (request hash field key_name), never the key."""
    try:
        return await intake.enqueue(queued, {"key_name": key.name} if key is not None else None)
    except QueueRefused as refused:
        if refused.code is QueueError.QUEUE_FULL:
            raise ApiError(
                429,
                f"The queue is full at priority {queued.priority}; retry later or at a higher priority.",
                code="queue_full",
                headers={"Retry-After": str(settings.retry_after_s), "x-strata-priority": str(queued.priority)},
            ) from None
        raise ApiError(409, f"Request id {queued.id} already exists.", code="duplicate_request") from None
# ---- reading the answer back --------------------------------------------------------------


class _Progress:
    finished = False


@asynccontextmanager
async def _cancel_unless_finished(services: Services, request_id: str) -> AsyncIterator[_Progress]:
    progress = _Progress()
    try:
        yield progress
    finally:
        if not progress.finished:
            with anyio.CancelScope(shield=True):
                await services.cancels.cancel(request_id)


async def _follow(
    request: Request, services: Services, request_id: str, progress: _Progress
) -> AsyncIterator[list[tuple[str | None, Event]]]:
    """Batches of output events (empty when none came within read_block_ms) up to and including
    the last one (Done or Failed). Stops early, unfinished, when the client has gone. Redis
    going away is waited out for redis_wait_s (the stream is in Redis: nothing is lost); past
    that the answer ends with an `unavailable` error event (its entry id None: not from Redis)."""
    settings = services.settings
    after = "0-0"
    down_since: float | None = None
    while True:
        try:
            batch: list[tuple[str | None, Event]] = list(
                await services.intake.read(request_id, after, settings.read_block_ms))
            down_since = None
        except UNAVAILABLE:
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since < settings.redis_wait_s:
                await anyio.sleep(OUTAGE_POLL_S)
                batch = []
            else:
                log.warning("%s: Redis unreachable for %.0f s; ending the answer", request_id, settings.redis_wait_s)
                batch = [(None, Failed(f"The queue (Redis) was unreachable for {settings.redis_wait_s:g} s; "
                                       "the request was cancelled. Retry it.", "unavailable"))]
        for i, (entry_id, event) in enumerate(batch):
            if isinstance(event, (Done, Failed)):
                progress.finished = entry_id is not None  # an end Redis holds; one given up on still cancels
                yield batch[: i + 1]
                return
        if batch:
            after = batch[-1][0]
        yield batch
        if await request.is_disconnected():
            return


async def collect(request: Request, services: Services, request_id: str) -> Answer:
    parts: list[str] = []
    async with _cancel_unless_finished(services, request_id) as progress:
        async with aclosing(_follow(request, services, request_id, progress)) as batches:
            async for batch in batches:
                for _entry_id, event in batch:
                    if isinstance(event, Token):
                        parts.append(event.text)
                    elif isinstance(event, Done):
                        usage = Usage.of(event.prompt_tokens, event.completion_tokens)
                        return Answer("".join(parts), event.finish_reason, usage)
                    else:
                        raise failure(event)
    raise ApiError(499, "The client closed the request.", code="client_closed")


def failure(event: Failed) -> ApiError:
    status = 503 if event.code in _UNAVAILABLE_CODES else 500
    return ApiError(status, event.message, code=event.code,
                    type="service_unavailable" if status == 503 else "server_error")


async def stream_events(request: Request, services: Services, job: Job, shape: Shape) -> AsyncIterator[bytes]:
    """SSE bytes: the opening chunk, one chunk per token event (id = its Redis stream entry id,
    so a client can resume), the finish chunk, the usage chunk when asked, then [DONE]."""
    async with _cancel_unless_finished(services, job.id) as progress:
        opening = shape.opening(job)
        yield _sse(opening) if opening is not None else b": accepted\n\n"
        quiet_since = time.monotonic()
        async with aclosing(_follow(request, services, job.id, progress)) as batches:
            async for batch in batches:
                if not batch:
                    if time.monotonic() - quiet_since >= KEEPALIVE_S:
                        quiet_since = time.monotonic()
                        yield KEEPALIVE_COMMENT
                    continue
                quiet_since = time.monotonic()
                for entry_id, event in batch:
                    if isinstance(event, Token):
                        if event.text:
                            yield _sse(shape.chunk(job, event.text, None), entry_id)
                    elif isinstance(event, Done):
                        yield _sse(shape.chunk(job, None, event.finish_reason), entry_id)
                        if job.include_usage:
                            yield _sse(shape.usage_chunk(job, Usage.of(event.prompt_tokens, event.completion_tokens)))
                        yield format_sse_event(data_str="[DONE]")
                    else:
                        error = failure(event)
                        yield _sse(ErrorBody(error=error.detail), entry_id)
                        yield format_sse_event(data_str="[DONE]")


def _sse(model: BaseModel, entry_id: str | None = None) -> bytes:  # None: no id line
    return format_sse_event(data_str=model.model_dump_json(), id=entry_id)


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item
