"""How long a request may wait for a slot (`queue_timeout`, seconds): from its body, else the
`x-strata-queue-timeout` header, else its API key's default; never above the key's maximum.
None: it waits as long as it takes. Unlike priority, a bad value is refused (400): a client
that asks for a deadline relies on it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from api.api_keys import ApiKey
from shapes.errors import ApiError

HEADER = "x-strata-queue-timeout"
MAX_S = 7 * 24 * 3600.0  # a week: anything longer is no deadline worth keeping in Redis


@dataclass(frozen=True)
class QueueTimeout:
    seconds: float
    asked: float | None  # what the request gave, before its key's maximum

    @property
    def lowered(self) -> bool:
        return self.asked is not None and self.seconds < self.asked

    @property
    def ms(self) -> int:
        return max(1, math.ceil(self.seconds * 1000))


def resolve_queue_timeout(body_value: float | None, header: str | None, key: ApiKey | None) -> QueueTimeout | None:
    asked = body_value if body_value is not None else _header_seconds(header)
    chosen = asked if asked is not None else (key.default_queue_timeout if key else None)
    if chosen is None:
        return None
    cap = key.max_queue_timeout if key else None
    return QueueTimeout(chosen if cap is None else min(chosen, cap), asked)


def _header_seconds(header: str | None) -> float | None:
    if header is None or not header.strip():
        return None
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not (0 < value <= MAX_S):
        raise ApiError(400, f"{HEADER} must be a number of seconds in (0, {MAX_S:g}]; got {header!r}.",
                       code="invalid_value", param=HEADER)
    return value
