"""Prefix affinity (a note under rule 2): a worker with a free slot leaves a newcomer, for at most
--affinity-wait-s, to an idle worker that advertises the newcomer's prompt prefix as held; it
picks the worker, never the order. The key (queues/affinity.py), the advertised set
(workers/affinity.py), the pure decision (scheduler.leave_for_prefix), then two real worker
loops over the fake engine with a paged pool, one virtual clock and a real Redis."""

from __future__ import annotations

from dataclasses import dataclass

from engine.fake import VirtualClock
from queues.affinity import affinity_key, span
from queues.claims import Waiting
from queues.keys import Keys
from queues.worker_state import WorkerState
from tests.helpers.queue import distinct_prompt
from tests.helpers.workers import MODEL, make_worker, run_until_idle
from workers import scheduler
from workers.affinity import HeldPrefixes
from workers.blocks import BlockPool
from workers.scheduler import Policy
from workers.slot import Phase, Slot

K = Keys(MODEL)
HEADER = distinct_prompt("affinity-header", 64)
KEY = affinity_key(HEADER + [0])  # any prompt that goes on past the 64-token header


# -- the key ---------------------------------------------------------------------------------


def test_the_key_covers_the_longest_whole_block_prefix_up_to_256_tokens():
    assert [span(n) for n in (0, 1, 64, 65, 128, 129, 300, 1500)] == [0, 0, 0, 64, 64, 128, 256, 256]
    assert affinity_key(list(range(64))) is None  # its last token is read again: no whole block to reuse
    long_a, long_b = list(range(1500)), list(range(300)) + [7] * 9
    assert affinity_key(long_a) == affinity_key(long_b)  # the same first 256 tokens
    assert affinity_key(HEADER + [1]) == affinity_key(HEADER + [2, 3])
    assert affinity_key(HEADER + [1]) != affinity_key(list(range(65)))
    assert len(affinity_key(HEADER + [1])) == 16


def test_the_key_is_on_the_request_hash_and_the_head_reads_it(redis_client, submit):
    submit("keyed", prompt=HEADER + [1, 2])
    submit("short", prompt_len=10)
    assert redis_client.hget(K.req("keyed"), "affinity") == affinity_key(HEADER + [1, 2])
    assert redis_client.hget(K.req("short"), "affinity") is None
    worker = make_worker(redis_client)
    assert [(w.id, w.affinity) for w in worker.claims.head(2)] == [("keyed", KEY),
                                                                   ("short", None)]


# -- what a worker advertises ----------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    id: str
    prompt: list[int]
    priority: int = 0


def test_a_prefix_is_advertised_while_in_a_slot_then_while_its_blocks_stay_cached():
    pool = BlockPool(num_tokens=8 * 16, block_size=16)
    slots = [Slot(0)]
    held = HeldPrefixes()
    request = Req("a", HEADER + [9])
    slots[0].request, slots[0].phase = request, Phase.READING
    held.note(request, pool)
    assert held.held(slots, pool) == [KEY]  # a read in progress: held
    pool.allocate(0, request.prompt, 0, 0)
    pool.grow(0, len(request.prompt))
    pool.write(0, request.prompt)
    pool.free(0)
    slots[0].release(1)
    assert held.held(slots, pool) == [KEY]  # its blocks are cached
    other = list(range(5000, 5000 + 8 * 16))
    pool.allocate(0, other, 0, 0)  # the whole pool, written: the header's blocks are evicted
    pool.grow(0, len(other))
    pool.write(0, other)
    assert held.held(slots, pool) == []


def test_at_most_the_limit_newest_first():
    held = HeldPrefixes(limit=3)
    slots = [Slot(0)]
    for i in range(5):
        held.note(Req(f"r{i}", distinct_prompt(f"r{i}", 70)), None)
    slots[0].cached = distinct_prompt("r4", 70)
    assert held.held(slots, None) == [affinity_key(distinct_prompt("r4", 70))]  # only what a slot still caches
    for s in range(3):
        slots.append(Slot(s + 1, cached=distinct_prompt(f"r{s + 1}", 70)))
    assert held.held(slots, None) == [affinity_key(distinct_prompt(f"r{i}", 70)) for i in (4, 3, 2)]


# -- the decision, pure ------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    worker: str
    prefixes: frozenset[str] = frozenset()
    waits_for_memory: bool = False


def pick(rid: str, key: str | None, priority: int = 0) -> Waiting:
    return Waiting(f"1:{rid}", rid, priority, 1, affinity=key)


def test_a_pick_is_left_to_an_idle_worker_holding_its_prefix_for_the_bound_only():
    p = pick("a", "k1")
    holders = [Peer("w1", frozenset({"k1"}))]
    assert scheduler.leave_for_prefix([p], [], holders, {}, 1000, Policy()) == ([], "w1")
    assert scheduler.leave_for_prefix([p], [], holders, {p.member: 1000}, 1499, Policy()) == ([], "w1")
    assert scheduler.leave_for_prefix([p], [], holders, {p.member: 1000}, 1500, Policy()) == ([p], None)
    assert scheduler.affinity_wakes_at({p.member: 1000}, 1200, Policy()) == 1500
    assert scheduler.affinity_wakes_at({p.member: 1000}, 1500, Policy()) is None


def test_a_pick_is_kept_when_nobody_else_can_take_it_with_its_prefix():
    p = pick("a", "k1")
    kept = ([p], None)
    assert scheduler.leave_for_prefix([p], ["k1"], [Peer("w1", frozenset({"k1"}))], {}, 0, Policy()) == kept  # held here too
    assert scheduler.leave_for_prefix([p], [], [Peer("w1", frozenset({"k2"}))], {}, 0, Policy()) == kept  # another prefix
    assert scheduler.leave_for_prefix([p], [], [Peer("w1", frozenset({"k1"}), True)], {}, 0, Policy()) == kept  # memory
    assert scheduler.leave_for_prefix([pick("b", None)], [], [Peer("w1", frozenset({"k1"}))], {}, 0, Policy()) == (
        [pick("b", None)], None)  # no key
    off = Policy(affinity_wait_s=0)
    assert scheduler.leave_for_prefix([p], [], [Peer("w1", frozenset({"k1"}))], {}, 0, off) == kept


def test_a_pick_without_the_key_ahead_is_kept_and_the_order_never_changes():
    urgent, keyed, after = pick("urgent", None, 9), pick("keyed", "k1"), pick("after", None)
    holders = [Peer("w1", frozenset({"k1"}))]
    # the picks before the left one are claimed, the ones after it are left too: service order holds
    assert scheduler.leave_for_prefix([urgent, keyed, after], [], holders, {}, 0, Policy()) == ([urgent], "w1")


# -- two worker loops --------------------------------------------------------------------------


def two_workers(redis_client, *, slots: int = 4, policy: Policy = Policy()):
    clock = VirtualClock()
    w1 = make_worker(redis_client, slots=slots, chunk=16, worker_id="w1", clock=clock, kv_tokens=1024, kv_block=16,
                     policy=policy)
    w2 = make_worker(redis_client, slots=4, chunk=16, worker_id="w2", clock=clock, kv_tokens=1024, kv_block=16,
                     policy=policy)
    return clock, w1, w2


def served_by(redis_client, rid: str) -> tuple[str, str]:
    return redis_client.hget(K.req(rid), "worker"), redis_client.hget(K.req(rid), "cached_tokens")


def read_first_on_w1(redis_client, submit, w1, w2, max_tokens: int = 3) -> None:
    assert not w2.step()  # idle, in the idle set
    submit("first", prompt=HEADER + [7, 8, 9], max_tokens=max_tokens)
    w1.step()
    run_until_idle(w1)
    published = WorkerState.from_hash(redis_client.hgetall(K.worker("w1")))
    assert published.prefixes == [KEY]  # visible in redis-cli: HGET ... prefixes


def test_two_requests_with_a_prefix_read_on_one_worker_are_both_served_there(redis_client, submit):
    _clock, w1, w2 = two_workers(redis_client)
    read_first_on_w1(redis_client, submit, w1, w2)
    submit("second", prompt=HEADER + [1, 2], max_tokens=3)
    submit("third", prompt=HEADER + [3, 4, 5], max_tokens=3)
    w1.read_log.clear()
    assert not w2.step()  # it would take "second" (a free slot, free lines): W1 holds the prefix and is idle
    assert redis_client.llen(K.wake_worker("w1")) == 1  # W1 is woken to take it
    for _ in range(6):  # the two in turn, each stepping; W2 leaves them both to W1
        w1.step()
        w2.step()
    run_until_idle(w1)
    assert served_by(redis_client, "second") == ("w1", "64") and served_by(redis_client, "third") == ("w1", "64")
    assert sorted(w1.read_log) == [("second", 2), ("third", 3)]  # each read only what follows the header
    assert w2.read_log == [] and w2.prompt_tokens_read == 0
    claims = [int(redis_client.hget(K.req(r), "claim_seq")) for r in ("first", "second", "third")]
    assert claims == sorted(claims)  # served in arrival order
    assert all(redis_client.hget(K.req(r), "status") == "finished" for r in ("second", "third"))


def test_a_worker_with_no_free_slot_is_not_waited_for(redis_client, submit):
    _clock, w1, w2 = two_workers(redis_client, slots=1)
    read_first_on_w1(redis_client, submit, w1, w2)
    submit("busy", prompt_len=8, max_tokens=50)
    w1.step()  # its only slot decodes "busy": not idle
    submit("second", prompt=HEADER + [1, 2], max_tokens=3)
    w2.step()
    assert served_by(redis_client, "second")[0] == "w2"


def test_past_the_bound_anyone_takes_it(redis_client, submit):
    clock, w1, w2 = two_workers(redis_client)
    read_first_on_w1(redis_client, submit, w1, w2)
    submit("second", prompt=HEADER + [1, 2], max_tokens=3)
    w2.step()
    assert redis_client.hget(K.req("second"), "status") == "waiting"
    clock.now_ms += 499  # W1 never comes (frozen, say)
    w2.step()
    assert redis_client.hget(K.req("second"), "status") == "waiting"
    clock.now_ms += 1
    w2.step()
    assert served_by(redis_client, "second") == ("w2", "0")
    run_until_idle(w2)
    assert sum(n for _, n in w2.read_log) == 66  # the whole prompt: its pool did not hold the header


def test_a_higher_priority_head_without_the_key_is_not_delayed(redis_client, submit):
    _clock, w1, w2 = two_workers(redis_client)
    read_first_on_w1(redis_client, submit, w1, w2)
    submit("keyed", prompt=HEADER + [1, 2], max_tokens=3)
    submit("urgent", priority=5, prompt_len=8, max_tokens=3)
    w2.step()
    assert served_by(redis_client, "urgent")[0] == "w2"  # claimed at W2's first look
    assert redis_client.hget(K.req("keyed"), "status") == "waiting"  # W1 takes that one
    w1.step()
    assert served_by(redis_client, "keyed") == ("w1", "64")


def test_off_the_first_free_worker_takes_it(redis_client, submit):
    _clock, w1, w2 = two_workers(redis_client, policy=Policy(affinity_wait_s=0))
    read_first_on_w1(redis_client, submit, w1, w2)
    submit("second", prompt=HEADER + [1, 2], max_tokens=3)
    w2.step()
    assert served_by(redis_client, "second") == ("w2", "0")


def test_a_worker_holding_a_head_back_for_memory_is_not_waited_for(redis_client, submit):
    clock = VirtualClock()
    # W1: 16 blocks of 16; "running" holds 5 (the header's 4 among them), so "urgent", which needs
    # 16 less the 4 it shares, waits for memory at W1's head
    w1 = make_worker(redis_client, slots=4, chunk=16, worker_id="w1", clock=clock, kv_tokens=256, kv_block=16)
    w2 = make_worker(redis_client, slots=4, chunk=16, worker_id="w2", clock=clock, kv_tokens=1024, kv_block=16)
    assert not w2.step()
    submit("running", prompt=HEADER + [1, 2, 3], max_tokens=10)
    w1.step()
    while any(s.phase is Phase.READING for s in w1.slots):
        w1.step()
    submit("urgent", priority=9, prompt=HEADER + [4] * 150, max_tokens=30)
    w1.step()
    assert w1.describe().waits_for_memory == "urgent"
    assert redis_client.hget(K.worker("w1"), "waits_for_memory") == "urgent"  # published at once
    assert redis_client.zscore(K.idle, "w1") is not None  # a free slot and free lines: idle all the same
    w2.step()
    assert served_by(redis_client, "urgent")[0] == "w2"
