"""Rule 1 of DESIGN.md: what a request's `priority` field counts as."""

from __future__ import annotations

from typing import Any


def parse_priority(raw: Any, lo: int, hi: int) -> int:
    """An integer counts as itself, clamped to [lo, hi]. Anything else (absent, null, a string,
    a float, a boolean) counts as 0, clamped too. Never an error: a client that sends a wrong
    type is served at the normal priority rather than refused."""
    value = raw if isinstance(raw, int) and not isinstance(raw, bool) else 0
    return max(lo, min(hi, value))
