"""What chat and text completions share: turn a validated body into a queued request (the rules
of shapes/rules.py, the priority of api/priority.py), enqueue it, then read the worker's output
back and answer whole or as a stream of SSE events, worded by the endpoint's `Shape`.

Whatever way a handler ends before the answer's last event (client gone, handler cancelled, Redis
error) the request is cancelled in Redis, so a worker never spends a slot on an answer nobody reads."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing, asynccontextmanager

import anyio
from fastapi import Request
from fastapi.responses import Response
from fastapi.sse import KEEPALIVE_COMMENT, EventSourceResponse, format_sse_event
from pydantic import BaseModel

from api.api_keys import ApiKey
from api.deps import REPLICA_HEADER, Services
from api.priority import Resolved, resolve_priority
from api.queue_timeout import HEADER as QUEUE_TIMEOUT_HEADER
from api.queue_timeout import QueueTimeout, resolve_queue_timeout
from api.settings import ApiSettings
from queues.connect import UNAVAILABLE
from queues.intake import Intake
from queues.records import Done, Event, Failed, QueuedRequest, Token
from queues.scripts import QueueError, QueueRefused
from shapes import choices
from shapes.answers import Answer, Endpoint, Job, Shape, Wording
from shapes.choices import Choices
from shapes.errors import ApiError, ErrorBody, failure
from shapes.fields import IGNORED_HEADER, header_value
from shapes.parsing import Reading
from shapes.requests import GenerationBody
from shapes.responses import RequestObject, Usage

log = logging.getLogger("strata.api")

KEEPALIVE_S = 15.0
# Bodies up to this size are tokenized on the event loop (~0.2 ms for a short chat, measured under
# load): a thread hop costs more. Larger ones (up to ms per KiB) go to a thread so as not to stall
# every other stream of this process.
INLINE_BODY_BYTES = 2048
OUTAGE_POLL_S = 0.5  # how often a stream looks for Redis again while it is away
# How often a reader asks whether its client is still there. Asking after every batch cost ~10 %
# of the API's CPU per streamed token; a stream's own writes notice a gone client anyway.
DISCONNECT_CHECK_S = 0.1


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_key_may_use(services: Services, key: ApiKey | None) -> None:
    """A key restricted to other models sees this one as not existing (404, as OpenAI does)."""
    if key is not None and not key.allows(services.model_name):
        raise ApiError(404, f"The model '{services.model_name}' does not exist or this key may not use it.",
                       code="model_not_found", param="model")


async def generate(
    request: Request, services: Services, body: GenerationBody, endpoint: Endpoint, key: ApiKey | None
) -> Response:
    """The one path both endpoints take: check, tokenize, resolve the priority, enqueue, answer."""
    ignored = services.rules.check(body)
    check_key_may_use(services, key)
    if int(request.headers.get("content-length") or INLINE_BODY_BYTES + 1) <= INLINE_BODY_BYTES:
        prompt = services.rules.prompt(body)  # a short prompt tokenizes faster than a hop to a thread
    else:
        prompt = await anyio.to_thread.run_sync(services.rules.prompt, body)
    priority = resolve_priority(body.priority, services.settings.priority_min, services.settings.priority_max, key)
    rules = await services.rules_now()
    queued = rules.queued(new_request_id(endpoint.id_prefix), body, prompt, priority.value)
    return await answer(request, services, queued, endpoint, body, priority, key, ignored,
                        services.rules.reading(body, prompt))


DETACH_HEADER = "x-strata-detach"


def wants_detach(request: Request, body: GenerationBody) -> bool:
    """The request keeps running when its client leaves: background, the header, or stream_options."""
    header = request.headers.get(DETACH_HEADER, "").strip().lower() in ("1", "true", "yes")
    return body.background or header or bool(body.stream_options and body.stream_options.detach)


async def answer(
    request: Request, services: Services, queued: QueuedRequest, endpoint: Endpoint, body: GenerationBody,
    priority: Resolved, key: ApiKey | None = None, ignored: list[str] | None = None,
    reading: Reading = Reading(),
) -> Response:
    """Enqueue, then answer whole or stream, or (background) only say it was accepted. `ignored`:
    the body's fields that are not OpenAI's, named in a header (shapes/fields.py)."""
    settings = services.settings
    timeout = resolve_queue_timeout(body.queue_timeout, request.headers.get(QUEUE_TIMEOUT_HEADER), key)
    job = Job(queued.id, int(time.time()), services.model_name, queued.priority, body.include_usage, reading, queued.n)
    detach = wants_detach(request, body)
    # what a reader by id needs to word the answer as this endpoint did (api/routes/requests.py)
    fields = {"endpoint": endpoint.path, "created": str(job.created), "include_usage": str(int(job.include_usage)),
              "detach": str(int(detach)), **job.reading.fields()}
    if key is not None:  # only the key's name goes to Redis, never the key
        fields["key_name"] = key.name
    await enqueue(services.intake, queued, settings, fields, timeout)
    # the script stored its own deadline (from the same clock, a moment earlier): asking from
    # here on is never early
    deadline_ms = services.intake.clock() + timeout.ms if timeout else None
    headers = {"x-request-id": queued.id, "x-strata-priority": str(queued.priority),
               REPLICA_HEADER: services.replica}
    if ignored:
        headers[IGNORED_HEADER] = header_value(ignored)
    if priority.lowered:  # the key's maximum lowered it: say so (asked->used)
        headers["x-strata-priority-lowered"] = f"{priority.asked}->{priority.value}"
    if timeout:
        headers[QUEUE_TIMEOUT_HEADER] = f"{timeout.seconds:g}"
        if timeout.lowered:
            headers["x-strata-queue-timeout-lowered"] = f"{timeout.asked:g}->{timeout.seconds:g}"
    if body.stream:
        events = stream_events(request, services, job, endpoint.shape, deadline_ms, cancel_on_leave=not detach)
        # Start the generator now: from here on, however the response ends, its guard cancels.
        first = await anext(events)
        return EventSourceResponse(_prepend(first, events), headers=headers)
    if body.background:
        headers["location"] = f"/v1/requests/{queued.id}"
        accepted = RequestObject(id=queued.id, endpoint=endpoint.path, model=job.model, created=job.created,
                                 priority=job.priority, status="waiting")
        return json_response(accepted, headers, 202)
    try:
        result = await collect(request, services, queued.id, deadline_ms, job.n)
    except ApiError as error:  # accepted, then failed (e.g. 408): the client still learns its id
        error.headers = {**headers, **error.headers}
        raise
    return json_response(choices.whole(endpoint.shape, job, result), headers)


def json_response(model: BaseModel, headers: dict[str, str], status_code: int = 200) -> Response:
    """The model as JSON, rendered by pydantic in one pass (not model_dump, then json.dumps:
    a third of the API's JSON work for a one-token answer)."""
    return Response(model.model_dump_json(), status_code=status_code, headers=headers, media_type="application/json")


async def enqueue(intake: Intake, queued: QueuedRequest, settings: ApiSettings, fields: dict[str, str],
                  timeout: QueueTimeout | None = None) -> int:
    """`fields` go onto the request hash beside what the queue writes (README's Redis table)."""
    try:
        return await intake.enqueue(queued, fields, timeout.ms if timeout else None)
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
async def _cancel_unless_finished(services: Services, request_id: str, enabled: bool = True,
                                  ) -> AsyncIterator[_Progress]:
    """Disabled for a detached request and for a reader that re-attached: their leaving cancels nothing."""
    progress = _Progress()
    try:
        yield progress
    finally:
        if enabled and not progress.finished:
            with anyio.CancelScope(shield=True):
                await services.cancels.cancel(request_id)


async def _follow(
    request: Request, services: Services, request_id: str, progress: _Progress, deadline_ms: int | None = None,
    after: str = "0-0", answers: int = 1,
) -> AsyncIterator[list[tuple[str | None, Event]]]:
    """Batches of output events (empty when none came within read_block_ms) up to and including
    the last one (the `answers`-th Done after `after`, or a Failed). Stops early, unfinished,
    when the client has gone. Redis going away is waited out for redis_wait_s (the stream is in
    Redis: nothing is lost); past that the answer ends with an `unavailable` error event (its
    entry id None: not from Redis). Past its queue deadline with nothing read yet, it asks Redis
    once to expire the request (a no-op if a worker claimed it): workers sweep too, but none need
    be alive. `after`: the entry id to read from (a client re-attaching with its Last-Event-ID)."""
    settings = services.settings
    down_since: float | None = None
    checked = time.monotonic()
    ended = 0
    async with services.reader.follow(request_id, after) as follower:
        while True:
            if deadline_ms is not None and after == "0-0" and services.intake.clock() >= deadline_ms:
                deadline_ms = None
                try:
                    await services.intake.expire_if_overdue(request_id)
                except UNAVAILABLE:
                    pass  # the workers' sweep expires it once Redis is back
            try:
                batch: list[tuple[str | None, Event]] = list(
                    await services.reader.next(follower, settings.read_block_ms))
                down_since = None
            except UNAVAILABLE:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since < settings.redis_wait_s:
                    await anyio.sleep(OUTAGE_POLL_S)
                    batch = []
                else:
                    log.warning("%s: Redis unreachable for %.0f s; ending the answer", request_id,
                                settings.redis_wait_s)
                    batch = [(None, Failed(f"The queue (Redis) was unreachable for {settings.redis_wait_s:g} s; "
                                           "the request was cancelled. Retry it.", "unavailable"))]
            for i, (entry_id, event) in enumerate(batch):
                if isinstance(event, Done):
                    ended += 1
                if isinstance(event, Failed) or ended >= answers:
                    progress.finished = entry_id is not None  # an end Redis holds; one given up on still cancels
                    yield batch[: i + 1]
                    return
            if batch:
                after = batch[-1][0]
            yield batch
            if time.monotonic() - checked >= DISCONNECT_CHECK_S or not batch:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return


async def _ended_before(services: Services, request_id: str, after: str) -> tuple[int, int]:
    """The answers whose Done is at or before entry `after`, and their tokens (a re-attach of a
    request of n; none from the start)."""
    if after == "0-0":
        return 0, 0
    dones = [event for entry_id, event in await services.intake.events(request_id)
             if isinstance(event, Done) and _entry(entry_id) <= _entry(after)]
    return len(dones), sum(d.completion_tokens for d in dones)


async def collect(request: Request, services: Services, request_id: str, deadline_ms: int | None = None,
                  n: int = 1) -> list[Answer]:
    parts = Choices(n)
    async with _cancel_unless_finished(services, request_id) as progress:
        async with aclosing(_follow(request, services, request_id, progress, deadline_ms, answers=n)) as batches:
            async for batch in batches:
                found = assemble(parts, (event for _entry_id, event in batch))
                if found is not None:
                    return found
    raise ApiError(499, "The client closed the request.", code="client_closed")


def assemble(parts: Choices, events: Iterable[Event]) -> list[Answer] | None:
    """Adds the events' text and logprobs to `parts`; the whole answers once each has ended (None
    before). Raises the request's failure (ApiError) at an error event."""
    for event in events:
        if isinstance(event, Failed):
            raise failure(event)
        if parts.add(event):
            return parts.answers()
    return None


async def stream_events(request: Request, services: Services, job: Job, shape: Shape,
                        deadline_ms: int | None = None, *, cancel_on_leave: bool = True,
                        after: str = "0-0") -> AsyncIterator[bytes]:
    """SSE bytes: the opening chunk, one chunk per token event (id = its Redis stream entry id,
    so a client can resume), the finish chunk, the usage chunk when asked, then [DONE]. From
    `after` (a re-attach) it starts with the first event after that entry; the opening chunk,
    which has no id, comes only with the whole stream."""
    wordings: dict[int, Wording] = {}  # one per answer: each holds its own split state
    offsets: dict[int, int] = {}  # characters of token text so far, per answer (completions' text_offset)
    # A split stream (tool calls, thinking) holds state from the answer's start: a re-attach reads
    # it all again, and sends only the chunks of the entries after `after`.
    replay_until = _entry(after) if not job.reading.is_plain and after != "0-0" else None
    if replay_until is not None:
        after = "0-0"
    async with _cancel_unless_finished(services, job.id, cancel_on_leave) as progress:
        opening = shape.opening(job) if after == "0-0" and replay_until is None else None
        if opening is None:
            yield b": accepted\n\n"
        else:  # each answer's role chunk, in one write
            yield b"".join(_sse(chunk) for i in range(job.n)
                           for chunk in choices.indexed([opening.model_copy(deep=True)], i))
        quiet_since = time.monotonic()
        # answers that ended before `after` (a re-attach of a request of n): their Dones are not read again
        ended, completion = await _ended_before(services, job.id, after) if job.n > 1 else (0, 0)
        async with aclosing(_follow(request, services, job.id, progress, deadline_ms, after,
                                    job.n - ended)) as batches:
            async for batch in batches:
                if not batch:
                    if time.monotonic() - quiet_since >= KEEPALIVE_S:
                        quiet_since = time.monotonic()
                        yield KEEPALIVE_COMMENT
                    continue
                quiet_since = time.monotonic()
                for entry_id, event in batch:
                    sent = replay_until is None or entry_id is None or _entry(entry_id) > replay_until
                    if isinstance(event, (Token, Done)) and event.choice not in wordings:
                        wordings[event.choice], offsets[event.choice] = shape.wording(job), 0
                    if isinstance(event, Token):
                        logprobs = (event.prompt_logprobs or []) + event.logprobs
                        wording, offset = wordings[event.choice], offsets[event.choice]
                        chunks = wording.text(event.text, logprobs, offset) if event.text or logprobs else []
                        offsets[event.choice] += sum(len(e.token) for e in logprobs)
                        for chunk in choices.indexed(chunks, event.choice) if sent else ():
                            yield _sse(chunk, entry_id)
                    elif isinstance(event, Done):
                        end = choices.indexed(wordings[event.choice].end(event.finish_reason), event.choice)
                        for chunk in end if sent else ():  # a replayed answer's end the client has
                            yield _sse(chunk, entry_id)
                        ended += 1
                        completion += event.completion_tokens
                        if ended < job.n:
                            continue
                        if job.include_usage:
                            yield _sse(shape.usage_chunk(job, Usage.of(event.prompt_tokens, completion)))
                        yield format_sse_event(data_str="[DONE]")
                    else:
                        error = failure(event)
                        yield _sse(ErrorBody(error=error.detail), entry_id)
                        yield format_sse_event(data_str="[DONE]")


def _entry(entry_id: str) -> tuple[int, int]:
    """A stream entry id (`<ms>-<n>`) in the order Redis gives them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _sse(model: BaseModel, entry_id: str | None = None) -> bytes:  # None: no id line
    return format_sse_event(data_str=model.model_dump_json(), id=entry_id)


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item
