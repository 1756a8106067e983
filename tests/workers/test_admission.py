"""Admission by memory (tier 1): the pool's free blocks decide, on top of the scheduling rules."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from workers import admission, scheduler
from workers.admission import Admission
from workers.blocks import BlockPool
from workers.scheduler import Policy, Reserve
from workers.slot import Phase, Slot

BS = 4


@dataclass
class Waiting:
    name: str
    priority: int
    prompt: list[int]
    max_tokens: int


def slots_of(n: int, busy: int = 0, reserve: tuple[Reserve, ...] = ()) -> list[Slot]:
    floors = scheduler.slot_floors(n, reserve)
    return [Slot(i, Phase.DECODING if i < busy else Phase.FREE, min_priority=floors[i]) for i in range(n)]


def test_a_head_that_does_not_fit_waits_and_nobody_behind_takes_its_memory():
    slots = slots_of(4, busy=1)
    head = Waiting("alert", 9, [1] * 30, 10)
    small = Waiting("small", 0, [2] * 3, 1)
    need = {"alert": 10, "small": 1}
    decision = admission.admit(slots, [head, small], Policy(), lambda w: need[w.name], num_free=6)
    assert decision == Admission(waits=head, blocks_short=4)
    # the same at one priority: first come, first served holds for memory too
    first = Waiting("alert", 0, [1] * 30, 10)
    assert admission.admit(slots, [first, small], Policy(), lambda w: need[w.name], num_free=6).waits is first
    assert admission.admit(slots, [head, small], Policy(), lambda w: need[w.name], num_free=10) == Admission(take=head)


def test_no_free_slot_admits_nobody_whatever_the_memory():
    slots = slots_of(2, busy=2)
    assert admission.admit(slots, [Waiting("a", 0, [1], 1)], Policy(), lambda w: 0, num_free=100) == Admission()
    assert admission.admit(slots_of(2), [], Policy(), lambda w: 0, num_free=100) == Admission()


def test_reserved_slots_still_decide_who_is_the_candidate():
    # the only free slot is reserved for priority >= 5: a low head is not the candidate, so it
    # neither takes the slot nor holds memory (it waits for a slot, not for blocks)
    slots = slots_of(2, busy=1, reserve=(Reserve(1, 5),))
    low, high = Waiting("low", 0, [1], 1), Waiting("high", 5, [1], 1)
    assert admission.admit(slots, [low], Policy(), lambda w: 1, num_free=0) == Admission()
    aging = Policy(aging_s=10.0)
    assert admission.admit(slots, [low, high], aging, lambda w: 1, num_free=1) == Admission(take=high)
    assert admission.admit(slots, [low, high], aging, lambda w: 2, num_free=1) == Admission(waits=high, blocks_short=1)


slot_states = st.lists(st.tuples(st.booleans(), st.sampled_from([None, 2, 5])), min_size=1, max_size=6)
queue = st.lists(st.integers(-3, 8), max_size=8)


@settings(max_examples=300, deadline=None)
@given(slot_states, queue, st.booleans(), st.integers(0, 50))
def test_when_every_request_fits_the_decision_is_the_scheduling_rules_exactly(states, priorities, aging, spare):
    slots = [Slot(i, Phase.FREE if free else Phase.DECODING, min_priority=floor)
             for i, (free, floor) in enumerate(states)]
    waiting = [Waiting(f"w{i}", p, [1] * (i + 1), i + 1) for i, p in enumerate(priorities)]
    policy = Policy(aging_s=10.0 if aging else None)
    need = {w.name: (i * 7) % 11 for i, w in enumerate(waiting)}
    num_free = max(need.values(), default=0) + spare
    decision = admission.admit(slots, waiting, policy, lambda w: need[w.name], num_free)
    assert decision == Admission(take=scheduler.pick_waiting(slots, waiting, policy))


def test_a_big_urgent_request_waits_at_the_head_and_small_ones_never_overtake_it():
    """A virtual-clock run on a real BlockPool: 2 requests decode long answers; an urgent one
    arrives that fits only once both are done; small low-priority ones keep arriving. None is
    admitted while the urgent one waits (the bound is zero overtakers), and the urgent one is
    admitted at the step the last running answer ends (its wait: the longest remaining answer)."""
    pool = BlockPool(num_tokens=12 * BS, block_size=BS)
    slots = slots_of(4)
    running: dict[int, int] = {}  # slot -> answer tokens still to come
    admitted: list[tuple[int, str]] = []
    queue: list[Waiting] = []

    def start(slot: Slot, w: Waiting, step: int) -> None:
        cached = pool.allocate(slot.index, w.prompt, w.max_tokens, w.priority)
        pool.write(slot.index, w.prompt[cached:])
        slot.phase, running[slot.index] = Phase.DECODING, w.max_tokens
        admitted.append((step, w.name))

    for i, answer in enumerate([6, 9]):  # 2 + 6 and 2 + 9 tokens: 2 and 3 blocks, 7 of 12 left
        start(slots[i], Waiting(f"long{i}", 0, [i + 1, 0], answer), step=0)
    urgent = Waiting("urgent", 9, [5] * (10 * BS - 1), 1)  # 10 blocks
    assert not pool.can_allocate(urgent.prompt, urgent.max_tokens)
    queue.append(urgent)
    for step in range(1, 20):
        queue.append(Waiting(f"small{step}", 0, [6, step], 1))  # 1 block each, would fit at once
        while True:
            queue.sort(key=lambda w: -w.priority)  # the Redis order: priority, then arrival
            decision = admission.admit(slots, queue, Policy(),
                                       lambda w: pool.blocks_needed(w.prompt, w.max_tokens), pool.num_free)
            if decision.take is None:
                break
            queue.remove(decision.take)
            start(scheduler.free_slot(slots, decision.take.prompt, Policy(), decision.take.priority),
                  decision.take, step)
        for index in list(running):  # one decode step; an answer that ends frees its blocks
            pool.write(index, [7])
            running[index] -= 1
            if running[index] == 0:
                del running[index]
                pool.free(index)
                slots[index].release(step)
    urgent_at = next(step for step, name in admitted if name == "urgent")
    assert urgent_at == 10  # long1's 9 tokens end in step 9; the urgent one reads in step 10
    assert [name for step, name in admitted if 0 < step < urgent_at] == []
    assert [name for step, name in admitted if step == urgent_at][:1] == ["urgent"]


def test_a_request_that_could_never_fit_is_refused_naming_both_numbers():
    # today's wording (shapes/rules.py) for a prompt that leaves no room
    assert admission.never_fits(8192, 0, max_model_len=8192, pool_tokens=16384) == (
        "This model's context is 8192 tokens; the prompt has 8192, which leaves no room for an answer."
    )
    assert admission.never_fits(8000, 500, max_model_len=8192, pool_tokens=16384) == (
        "This model's context is 8192 tokens; the prompt (8000) plus max_tokens (500) is 8500."
    )
    assert admission.never_fits(8000, 192, max_model_len=8192, pool_tokens=16384) is None
    assert admission.never_fits(3000, 1200, max_model_len=8192, pool_tokens=4096) == (
        "The KV pool holds 4096 tokens; the prompt (3000) plus max_tokens (1200) is 4200."
    )
    # fits only when the pool is empty: not refused, it waits its turn
    assert admission.never_fits(3000, 1096, max_model_len=8192, pool_tokens=4096) is None
