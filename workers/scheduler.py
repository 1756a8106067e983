"""The scheduling decisions, and nothing else: no Redis, no torch, no clock. The worker loop
asks; the answers depend only on the state passed in, so they are tested exactly.

The rules (DESIGN.md, "Scheduling rules"):
- a free slot goes to the highest-priority waiting request, first come first served within a
  level (the Redis queue's order), and to the worker whose lines are free if there is one;
- the lines go to the highest-priority read; a read that gave way waits until the read it gave
  way to is done (its epoch), then queues like the others;
- at a chunk boundary a read gives way to a higher priority whatever its length, within its own
  level only to a prompt under half as long, never to a lower priority, at most yields_max times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from workers.slot import Phase, Slot


@dataclass(frozen=True)
class Policy:
    prefill_preempt: bool = True
    yields_max: int = 2
    batch_groups: int = 1  # 1: no groups
    slot_low_first: bool = True


@dataclass(frozen=True)
class Lines:
    """Who reads next, and whether the read that had the lines gave way to get there."""

    read: Slot | None
    gave_way: Slot | None = None


def outranks(newcomer: Slot, current: Slot) -> bool:
    """Rule 4: higher priority always; same priority only under half as long; lower never."""
    if newcomer.priority != current.priority:
        return newcomer.priority > current.priority
    return 2 * len(newcomer.tokens) < len(current.tokens)


def free_slot(slots: Sequence[Slot], prompt: Sequence[int], policy: Policy) -> Slot | None:
    """Rule 9. Among free slots: with batch groups, the group with the fewest busy slots first,
    then its lowest free slot (or least recently used with slot_low_first off); without groups,
    the slot holding the longest prefix of the prompt, then the least recently used."""
    free = [s for s in slots if s.is_free]
    if not free:
        return None
    if policy.batch_groups > 1:
        size = max(1, len(slots) // policy.batch_groups)
        busy = [0] * policy.batch_groups
        for s in slots:
            if not s.is_free:
                busy[min(s.index // size, policy.batch_groups - 1)] += 1
        group = lambda s: busy[min(s.index // size, policy.batch_groups - 1)]  # noqa: E731
        order = (lambda s: s.index) if policy.slot_low_first else (lambda s: s.last_used)
        return min(free, key=lambda s: (group(s), order(s), s.index))
    return min(free, key=lambda s: (-shared_prefix(s.cached, prompt), s.last_used, s.index))


def shared_prefix(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """Tokens of the prompt a slot's cache already holds; the last prompt token is always read
    again, since its logits give the first answer token."""
    n = 0
    for a, b in zip(cached, prompt[:-1]):
        if a != b:
            break
        n += 1
    return n


def admit_here(lines_busy: bool, idle_elsewhere: bool) -> bool:
    """Rule 4's last sentence: when another worker has a free slot and free lines, a newcomer
    goes there instead of making a read here give way or wait."""
    return not lines_busy or not idle_elsewhere


def next_read(slots: Sequence[Slot], current: Slot | None, policy: Policy) -> Lines:
    """Who gets the lines at this chunk boundary. `current` is the read that had them."""
    reading = [s for s in slots if s.phase is Phase.READING]
    if current is not None and current.phase is Phase.READING:
        if not policy.prefill_preempt or current.yields >= policy.yields_max:
            return Lines(current)
        rivals = [s for s in reading if s is not current and not in_epoch(s, slots) and outranks(s, current)]
        best = _first(rivals)
        return Lines(best, gave_way=current) if best else Lines(current)
    ready = [s for s in reading if not in_epoch(s, slots)] or reading  # never stall the lines
    return Lines(_first(ready))


def in_epoch(slot: Slot, slots: Sequence[Slot]) -> bool:
    """A read that gave way lets others go first until the read it gave way to is done."""
    if slot.gave_way_to is None:
        return False
    return any(s.phase is Phase.READING and s.request and s.request.id == slot.gave_way_to for s in slots)


def _first(candidates: Sequence[Slot]) -> Slot | None:
    return min(candidates, key=lambda s: (-s.priority, s.claim_seq), default=None)


def decoding(slots: Sequence[Slot]) -> list[Slot]:
    return [s for s in slots if s.phase is Phase.DECODING]
