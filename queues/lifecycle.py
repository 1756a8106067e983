"""A request's lifecycle, named once. The Lua scripts spell these values (Lua has no enum);
tests/queues/test_lifecycle_table.py reads every script and checks it makes only the moves below.

    waiting ──claim──▶ running ──finish──▶ finished | failed | cancelled
       ▲                  │
       └─────requeue──────┘   (its lease ran out, or its worker handed it back)
    waiting ──cancel──▶ cancelled
    waiting ──claim | expire──▶ expired (its queue_timeout passed before any worker claimed it)
    running ──requeue──▶ failed (lost by too many workers) | cancelled (asked while its worker was gone)
"""

from __future__ import annotations

import enum


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self in FINAL


FINAL = frozenset({RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.EXPIRED})

# Every allowed move: (from, to, the script that makes it). None: the request is new.
TRANSITIONS: frozenset[tuple[RequestStatus | None, RequestStatus, str]] = frozenset({
    (None, RequestStatus.WAITING, "enqueue"),
    (RequestStatus.WAITING, RequestStatus.RUNNING, "claim"),
    (RequestStatus.WAITING, RequestStatus.CANCELLED, "cancel"),
    (RequestStatus.WAITING, RequestStatus.EXPIRED, "claim"),
    (RequestStatus.WAITING, RequestStatus.EXPIRED, "expire"),
    (RequestStatus.RUNNING, RequestStatus.WAITING, "requeue"),
    (RequestStatus.RUNNING, RequestStatus.FAILED, "requeue"),
    (RequestStatus.RUNNING, RequestStatus.CANCELLED, "requeue"),
    (RequestStatus.RUNNING, RequestStatus.FINISHED, "finish"),
    (RequestStatus.RUNNING, RequestStatus.FAILED, "finish"),
    (RequestStatus.RUNNING, RequestStatus.CANCELLED, "finish"),
})
