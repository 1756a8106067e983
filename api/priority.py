"""docs/design.md rule 1: what a request's `priority` field counts as."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.api_keys import ApiKey


def parse_priority(raw: Any, lo: int, hi: int) -> int:
    """An integer counts as itself, clamped to [lo, hi]. Anything else (absent, null, a string,
    a float, a boolean) counts as 0, clamped too. Never an error: a client that sends a wrong
    type is served at the normal priority rather than refused."""
    value = raw if isinstance(raw, int) and not isinstance(raw, bool) else 0
    return max(lo, min(hi, value))


@dataclass(frozen=True)
class Resolved:
    """A request's effective priority, and what it asked before its key's maximum."""

    value: int
    asked: int

    @property
    def lowered(self) -> bool:
        return self.value < self.asked


def resolve_priority(raw: Any, lo: int, hi: int, key: ApiKey | None = None) -> Resolved:
    """Rule 1 with an API key: what is not an integer counts as the key's default priority
    (instead of 0); the result is clamped to [lo, hi] as without a key, then lowered to the
    key's maximum where it is above it."""
    given = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    if given is None and key is not None:
        given = key.default_priority
    asked = parse_priority(given, lo, hi)
    cap = key.max_priority if key is not None else None
    return Resolved(asked if cap is None else min(asked, cap), asked)
