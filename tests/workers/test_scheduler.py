"""The pure scheduling decisions (tier 1): no Redis, no torch, no clock."""

from __future__ import annotations

from queues.records import QueuedRequest
from workers import scheduler
from workers.scheduler import Policy
from workers.slot import Phase, Slot


def reading(index: int, priority: int, length: int, seq: int, read_pos: int = 0, **kw) -> Slot:
    request = QueuedRequest(id=f"r{index}", priority=priority, prompt=[1] * length, max_tokens=1)
    return Slot(index, Phase.READING, request, claim_seq=seq, tokens=list(request.prompt), read_pos=read_pos, **kw)


def free(index: int, **kw) -> Slot:
    return Slot(index, **kw)


def test_a_read_gives_way_to_a_higher_priority_of_the_same_length():
    current = reading(0, priority=0, length=1000, seq=1, read_pos=256)
    newcomer = reading(1, priority=5, length=1000, seq=2)
    lines = scheduler.next_read([current, newcomer], current, Policy())
    assert lines.read is newcomer and lines.gave_way is current


def test_never_to_a_lower_priority_however_short():
    current = reading(0, priority=5, length=1000, seq=1, read_pos=256)
    short = reading(1, priority=0, length=3, seq=2)
    assert scheduler.next_read([current, short], current, Policy()) == scheduler.Lines(current)


def test_within_a_level_only_to_a_prompt_under_half_as_long():
    current = reading(0, priority=2, length=1000, seq=1, read_pos=256)
    half = reading(1, priority=2, length=500, seq=2)
    under = reading(2, priority=2, length=499, seq=3)
    assert scheduler.next_read([current, half], current, Policy()).read is current
    assert scheduler.next_read([current, half, under], current, Policy()).read is under


def test_yields_max_and_the_switch_off():
    current = reading(0, priority=0, length=1000, seq=1, read_pos=256, yields=2)
    urgent = reading(1, priority=9, length=10, seq=2)
    assert scheduler.next_read([current, urgent], current, Policy(yields_max=2)).read is current
    current.yields = 0
    assert scheduler.next_read([current, urgent], current, Policy(prefill_preempt=False)).read is current
    assert scheduler.next_read([current, urgent], current, Policy()).read is urgent


def test_a_read_that_gave_way_waits_for_its_epoch():
    parked = reading(0, priority=9, length=1000, seq=1, read_pos=256, gave_way_to="r1")
    first = reading(1, priority=9, length=100, seq=2, read_pos=64)
    # r1 has the lines; the parked read does not take them back while r1 is reading
    assert scheduler.next_read([parked, first], first, Policy()).read is first
    assert scheduler.next_read([parked, first], None, Policy()).read is first
    first.phase = Phase.DECODING  # r1's read is done: the epoch passed
    assert scheduler.next_read([parked, first], None, Policy()).read is parked


def test_the_lines_go_by_priority_then_arrival():
    a = reading(0, priority=0, length=10, seq=1)
    b = reading(1, priority=3, length=10, seq=3)
    c = reading(2, priority=3, length=10, seq=2)
    assert scheduler.next_read([a, b, c], None, Policy()).read is c


def test_slot_choice_prefers_the_longest_held_prefix_then_least_recently_used():
    slots = [free(0, last_used=5, cached=[1, 2, 3, 4]), free(1, last_used=1, cached=[1, 2, 9]),
             free(2, last_used=2)]
    assert scheduler.free_slot(slots, [1, 2, 3, 4, 5], Policy(), priority=0).index == 0
    assert scheduler.free_slot(slots, [7, 7], Policy(), priority=0).index == 1  # no prefix anywhere: LRU
    # the prompt's last token is always read again: a cache holding the whole prompt counts one less
    assert scheduler.shared_prefix([1, 2, 3], [1, 2, 3]) == 2


def test_an_empty_groups_first_request_takes_its_slot_0():
    # 2 groups of 2; group 0 has a busy slot, group 1 is empty and LRU order points at its slot 1
    busy = Slot(0, Phase.DECODING)
    slots = [busy, free(1, last_used=9), free(2, last_used=7), free(3, last_used=3)]
    assert scheduler.free_slot(slots, [1, 2], Policy(batch_groups=2), priority=0).index == 2
    assert scheduler.free_slot(slots, [1, 2], Policy(batch_groups=2, slot_low_first=False), priority=0).index == 3

