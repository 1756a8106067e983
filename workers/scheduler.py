"""The scheduling decisions, and nothing else: no Redis, no torch, no clock. The worker loop
asks; the answers depend only on the state passed in, so they are tested exactly.

The rules are docs/design.md's "Scheduling rules", cited by number:
- a free slot goes to the highest-priority waiting request, first come first served within a
  level (the Redis queue's order: rule 2), and to the worker whose lines are free if there is
  one (rule 4, admit_here, is_idle);
- the lines go to the highest-priority read (rule 3); a read that gave way waits until the read
  it gave way to is done (its epoch, rule 6), then queues like the others;
- at a chunk boundary a read gives way to a higher priority whatever its length, within its own
  level only to a prompt under half as long, never to a lower priority, at most yields_max times
  (rule 4, outranks);
- which worker serves a newcomer whose prompt prefix another idle worker holds (a note under
  rule 2: it picks the worker, never the order, and for at most affinity_wait_s: leave_for_prefix);
- which free slot (rule 9, free_slot); reserved slots (--reserve N:P) take only requests of
  priority >= P, and such a request takes one only when no slot of a lower class is free
  (rule 10, allowed_slots, pick_waiting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Mapping, Protocol, Sequence, TypeVar

from workers.slot import Phase, Slot

RESERVED_LOOKAHEAD = 64  # with aging: how far down the queue a free reserved slot looks for its tier


@dataclass(frozen=True)
class Reserve:
    """`--reserve N:P`: N slots of each worker take only requests of priority >= P."""

    count: int
    min_priority: int


@dataclass(frozen=True)
class Policy:
    prefill_preempt: bool = True
    yields_max: int = 2
    batch_groups: int = 1  # 1: no groups
    slot_low_first: bool = True
    reserve: tuple[Reserve, ...] = ()
    aging_s: float | None = None  # a waiting request's priority rises by 1 every aging_s (in Redis's order)
    # the longest a worker leaves a newcomer to another that holds its prompt's prefix (0: never)
    affinity_wait_s: float = 0.5


def slot_floors(num_slots: int, reserve: Sequence[Reserve]) -> list[int | None]:
    """The minimum priority of each slot (None: anyone). Reserved slots are the highest-numbered,
    the highest tier last, so lowest-free-first slot choice fills unreserved slots first and an
    operator reads the layout off the slot numbers."""
    floors: list[int | None] = [None] * num_slots
    index = num_slots
    for tier in sorted(reserve, key=lambda r: -r.min_priority):
        for _ in range(tier.count):
            index -= 1
            if index < 0:
                raise ValueError(f"--reserve asks for more slots than the {num_slots} there are")
            floors[index] = tier.min_priority
    return floors


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


def allowed_slots(slots: Sequence[Slot], priority: int) -> list[Slot]:
    """The free slots a request of this priority may take: unreserved ones if any is free, else
    those of the lowest reserved tier it qualifies for (a higher tier is kept for higher
    priorities still)."""
    free = [s for s in slots if s.is_free and s.admits(priority)]
    if not free:
        return []
    best = min(_tier(s) for s in free)
    return [s for s in free if _tier(s) == best]


def _tier(slot: Slot) -> float:
    return -math.inf if slot.min_priority is None else slot.min_priority


def can_admit(slots: Sequence[Slot], priority: int, n: int = 1) -> bool:
    """A request of n answers needs n free slots that take its priority, all at once."""
    return sum(1 for s in slots if s.is_free and s.admits(priority)) >= n


def free_slot(slots: Sequence[Slot], prompt: Sequence[int], policy: Policy, priority: int) -> Slot | None:
    """Rule 9 within the slots this priority may take (allowed_slots). With batch groups, the
    group with the fewest busy slots first, then its lowest free slot (or least recently used
    with slot_low_first off); without groups, the slot holding the longest prefix of the prompt,
    then the least recently used."""
    free = allowed_slots(slots, priority)
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


class Queued(Protocol):
    """A waiting request as the scheduler sees it; one with an `n` takes that many slots (its
    answers), one without takes one."""

    @property
    def priority(self) -> int: ...


W = TypeVar("W", bound=Queued)


def pick_waiting(slots: Sequence[Slot], waiting: Sequence[W], policy: Policy) -> W | None:
    """Which of the waiting requests (the queue's head, in service order) a free slot takes now;
    None: nobody. The head, if a free slot admits it. When only reserved slots are free and the
    head is below them: without aging the head has the highest priority, so nobody behind
    qualifies either; with aging an older, lower request may lead a higher one that a reserved
    slot admits, so the first of `waiting` that one admits. A request of n answers takes n slots
    together: until that many are free it waits at the head, and nobody behind it overtakes
    (the slots that free up are kept for it, as a read that does not fit waits in the lines)."""
    for candidate in waiting:
        if can_admit(slots, candidate.priority, getattr(candidate, "n", 1)):
            return candidate
        if policy.aging_s is None:
            return None
    return None


def pick_many(slots: Sequence[Slot], waiting: Sequence[W], policy: Policy) -> list[W]:
    """The waiting requests the free slots take now, in service order: pick_waiting again and
    again, each pick's slots counted as taken (its n, in the lowest tier it may use, as
    allowed_slots gives them), until one does not fit (it then waits at the head: nobody behind
    it is taken) or the slots run out. One step's admissions, claimed in one round trip."""
    free = [s for s in slots if s.is_free]
    taken: list[W] = []
    for candidate in waiting:
        n = getattr(candidate, "n", 1)
        fits = sorted((s for s in free if s.admits(candidate.priority)), key=lambda s: (_tier(s), s.index))
        if len(fits) < n:
            if policy.aging_s is None:
                break
            continue
        taken.append(candidate)
        for slot in fits[:n]:
            free.remove(slot)
    return taken


def look_further(head: Sequence[Queued], policy: Policy) -> bool:
    """pick_waiting found nobody in `head`: is it worth reading RESERVED_LOOKAHEAD of the queue?
    Only with aging (see pick_waiting), and only when the queue has more than was read."""
    return policy.aging_s is not None and 0 < len(head) < RESERVED_LOOKAHEAD


def lines_free(slots: Sequence[Slot]) -> bool:
    """No prompt is being read: a newcomer's read would start at once."""
    return not any(s.phase is Phase.READING for s in slots)


def is_idle(slots: Sequence[Slot]) -> bool:
    """What the worker tells the fleet as "idle": any newcomer can land here and read at once.
    A free reserved slot does not count (it would turn most newcomers away), and a busy worker
    that left its newcomer to us (admit_here) would then make it wait for nothing."""
    return lines_free(slots) and any(s.is_free and not s.is_reserved for s in slots)


def first_token_early(read_ended: bool, decoding: Sequence[Slot]) -> bool:
    """A read that ended this step reports its first token at once, before the step's decode of
    the other slots: an alert in a reserved slot then waits for its own read, not for a decode
    too. One more round trip, only in the steps where a read ends beside decodes."""
    return read_ended and bool(decoding)


def admit_here(lines_busy: bool, idle_elsewhere: bool) -> bool:
    """Rule 4's last sentence: when another worker has a free slot and free lines, a newcomer
    goes there instead of making a read here give way or wait."""
    return not lines_busy or not idle_elsewhere


class Holder(Protocol):
    """Another worker that could take a newcomer now (queues/membership.py `Peer`: in the idle set,
    so a free unreserved slot and free lines), what it advertises, and whether its pool holds a
    head back for memory (then it takes nothing now)."""

    @property
    def worker(self) -> str: ...

    @property
    def prefixes(self) -> Collection[str]: ...

    @property
    def waits_for_memory(self) -> bool: ...


def leave_for_prefix(picks: Sequence[W], held_here: Collection[str], holders: Sequence[Holder],
                     left_since: Mapping[str, int], now_ms: int, policy: Policy) -> tuple[list[W], str | None]:
    """Prefix affinity, a note under rule 2: of this step's picks (service order, each one this
    worker would claim now), those it keeps, and the worker it leaves the next one to (None: it
    keeps them all). A pick is left only while all of this holds: its prompt has an affinity key;
    this worker does not hold that prefix; another worker that holds it could take it now (idle:
    a free slot and free lines; not waiting for memory); and this worker first left it less than
    affinity_wait_s ago (`left_since`: member -> ms). The picks after a left one are left too, so
    requests are still claimed in service order, whoever claims them: only the worker changes.
    A pick without a key (a higher priority, say) is never delayed by one behind it with a key."""
    bound_ms = int(policy.affinity_wait_s * 1000)
    if bound_ms <= 0:
        return list(picks), None
    for i, pick in enumerate(picks):
        key = getattr(pick, "affinity", None)
        if not key or key in held_here:
            continue
        member = getattr(pick, "member", "")
        if now_ms - left_since.get(member, now_ms) >= bound_ms:
            continue
        holder = next((h.worker for h in holders if key in h.prefixes and not h.waits_for_memory), None)
        if holder is not None:
            return list(picks[:i]), holder
    return list(picks), None


def affinity_wakes_at(left_since: Mapping[str, int], now_ms: int, policy: Policy) -> int | None:
    """When the next pick left to another worker becomes this worker's to take (ms), or None:
    none is left, or every wait is over already."""
    ends = [t + int(policy.affinity_wait_s * 1000) for t in left_since.values()]
    return min((end for end in ends if end > now_ms), default=None)


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


def short_read(slots: Sequence[Slot], policy: Policy, budget: int) -> Slot | None:
    """After the step's read ended within its chunk: the read next in line (next_read's choice
    with the lines free: rules 3 and 6), if what is left of the chunk's `budget` holds the whole
    of it; None otherwise. Short prompts thus share one step in priority order, and one that
    does not fit whole is never skipped for a shorter one behind it: it reads next step."""
    if budget <= 0:
        return None
    nxt = next_read(slots, None, policy).read
    if nxt is None or len(nxt.tokens) - nxt.read_pos > budget:
        return None
    return nxt


def in_epoch(slot: Slot, slots: Sequence[Slot]) -> bool:
    """A read that gave way lets others go first until the read it gave way to is done."""
    if slot.gave_way_to is None:
        return False
    return any(s.phase is Phase.READING and s.request and s.request.id == slot.gave_way_to for s in slots)


def _first(candidates: Sequence[Slot]) -> Slot | None:
    return min(candidates, key=lambda s: (-s.priority, s.claim_seq), default=None)


def decoding(slots: Sequence[Slot]) -> list[Slot]:
    return [s for s in slots if s.phase is Phase.DECODING]
