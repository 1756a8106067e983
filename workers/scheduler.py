"""The scheduling decisions, and nothing else: no Redis, no torch, no clock. The worker loop
asks; the answers depend only on the state passed in, so they are tested exactly."""

from __future__ import annotations

from typing import Sequence

from workers.slot import Phase, Slot


def free_slot(slots: Sequence[Slot]) -> Slot | None:
    """The slot a newcomer gets: the lowest free one."""
    return next((s for s in slots if s.is_free), None)


def next_read(slots: Sequence[Slot]) -> Slot | None:
    """Who gets the lines: the highest-priority read, first come first served within a level."""
    reading = [s for s in slots if s.phase is Phase.READING]
    return min(reading, key=lambda s: (-s.priority, s.seq), default=None)


def decoding(slots: Sequence[Slot]) -> list[Slot]:
    return [s for s in slots if s.phase is Phase.DECODING]
