"""The Lua scripts, one per state change, and the error codes they return."""

from __future__ import annotations

import enum
from importlib import resources

import redis.exceptions


class QueueError(enum.Enum):
    QUEUE_FULL = "QUEUE_FULL"
    DUPLICATE = "DUPLICATE"


class QueueRefused(Exception):
    def __init__(self, code: QueueError) -> None:
        super().__init__(code.value)
        self.code = code


def source(name: str) -> str:
    return resources.files("queues").joinpath("lua", f"{name}.lua").read_text()


SCRIPT_NAMES = ("enqueue", "claim", "report", "finish", "requeue", "cancel", "expire")
# Lua has no import: the scripts that fence or end a request get the shared functions in front.
WITH_LIB = ("claim", "report", "finish", "requeue", "expire")


def request_script(name: str) -> str:
    return (source("_lib") + "\n" if name in WITH_LIB else "") + source(name)


def register(client) -> dict:  # noqa: ANN001 - sync or asyncio redis client
    """Scripts bound to a client (sync or asyncio); called with keys= and args=."""
    return {name: client.register_script(request_script(name)) for name in SCRIPT_NAMES}


def refused(error: redis.exceptions.ResponseError) -> QueueRefused | None:
    text = str(error)
    for code in QueueError:
        if text.startswith(code.value):
            return QueueRefused(code)
    return None


def enqueue_call(keys, request, now_ms: int, max_waiting: int, hard_limit: int,  # noqa: ANN001
                 fields: dict[str, str] | None = None, queue_timeout_ms: int | None = None) -> dict[str, list]:
    """keys= and args= of enqueue.lua for one request (the API's and the batch job's enqueue).
    `queue_timeout_ms`: not claimed within it, the request expires (None: it waits as long as
    it takes)."""
    extra = [item for pair in (fields or {}).items() for item in pair]
    prompt = "[" + ",".join(map(str, request.prompt)) + "]"
    deadline = "" if queue_timeout_ms is None else now_ms + queue_timeout_ms
    return {
        "keys": [keys.seq, keys.waiting, keys.req(request.id), keys.wake, keys.deadlines, keys.policy],
        "args": [request.id, request.priority, prompt, len(request.prompt), request.params_json(),
                 now_ms, max_waiting, hard_limit, deadline, *extra],
    }
