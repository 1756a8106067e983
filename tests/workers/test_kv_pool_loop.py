"""The worker loop over a paged KV pool (the fake engine with kv_tokens, a real Redis): admission
by memory, prefixes shared across slots and requests, blocks given back, and what the worker hash
and the request hash say. Exact, on the virtual clock."""

from __future__ import annotations

from queues.keys import Keys
from queues.worker_state import WorkerState
from tests.helpers.queue import distinct_prompt
from tests.helpers.workers import MODEL, make_worker, run_until_idle

K = Keys(MODEL)
BS = 16


def pooled(redis_client, *, kv_tokens: int, slots: int = 4, chunk: int = 16, **kw):
    return make_worker(redis_client, slots=slots, chunk=chunk, kv_tokens=kv_tokens, kv_block=BS, **kw)


def stream(redis_client, rid):
    return [f for _, f in redis_client.xrange(K.out(rid))]


def claim_order(redis_client, rids):
    return sorted(rids, key=lambda r: int(redis_client.hget(K.req(r), "claim_seq")))


def test_a_long_prompt_beside_short_ones_on_one_pool(redis_client, submit):
    # 4 slots sharing 512 tokens: a 300-token prompt (beyond a slot's share of 128) runs beside
    # three short ones, each reserving prompt + max_tokens
    submit("long", prompt_len=300, max_tokens=20)
    for i in range(3):
        submit(f"short{i}", prompt_len=20, max_tokens=10)
    worker = pooled(redis_client, kv_tokens=512)
    worker.step()
    worker.step()
    assert sorted(s.request.id for s in worker.slots if s.request) == ["long", "short0", "short1", "short2"]
    pool = worker.pool.blocks
    # reserved: ceil(320 / 16) = 20 blocks for the long one, ceil(30 / 16) = 2 for each short one
    assert pool.num_used + pool.num_reserved == 20 + 3 * 2
    run_until_idle(worker)
    for rid, n in (("long", 20), ("short0", 10), ("short1", 10), ("short2", 10)):
        assert redis_client.hget(K.req(rid), "completion_tokens") == str(n)
        assert redis_client.hget(K.req(rid), "status") == "finished"
    assert pool.num_used == pool.num_reserved == 0 and pool.num_free == pool.num_blocks
    assert worker.engine.tables == [[]] * 4  # every slot's table cleared as it ended


def test_a_high_priority_request_that_does_not_fit_waits_at_the_head(redis_client, submit):
    # 8 blocks of 16: a running request holds 5 of them; the urgent one needs 6 (80 + 10 tokens),
    # and small low-priority ones that would fit in the 3 left do not overtake it
    submit("running", prompt_len=60, max_tokens=20)
    worker = pooled(redis_client, kv_tokens=128)
    worker.step()
    submit("urgent", priority=9, prompt_len=80, max_tokens=10)
    for i in range(3):
        submit(f"small{i}", prompt_len=8, max_tokens=4)
    worker.step()
    assert [s.request.id for s in worker.slots if s.request] == ["running"]
    state = worker.describe()
    assert (state.waits_for_memory, state.blocks_short) == ("urgent", 6 - 3)
    published = WorkerState.from_hash(state.to_hash())
    assert published.waits_for_memory == "urgent" and published.blocks_short == 3
    assert (published.blocks_total, published.blocks_free, published.kv_block) == (8, 3, BS)
    while worker.slots[0].request is not None and worker.slots[0].request.id == "running":
        worker.step()
        assert all(s.request is None or s.request.id in ("running", "urgent") for s in worker.slots)
    run_until_idle(worker)
    assert claim_order(redis_client, ["running", "urgent", "small0", "small1", "small2"])[:2] == ["running", "urgent"]
    assert all(redis_client.hget(K.req(r), "status") == "finished" for r in ("urgent", "small0", "small1", "small2"))


def test_a_head_waiting_for_memory_on_one_worker_is_taken_by_another_that_has_it(redis_client, submit):
    # "full" (8 blocks) runs a request holding 5, so the urgent one (6 blocks) waits at its head and
    # holds back the small one behind it. A second worker with room takes the urgent one at its
    # next step (it is the global head, rule 2), and the small one is served then, while the
    # running request still runs: memory one worker lacks holds nobody back when another has it.
    submit("running", prompt_len=60, max_tokens=40)
    full = pooled(redis_client, kv_tokens=128, worker_id="full")
    full.step()
    submit("urgent", priority=9, prompt_len=80, max_tokens=10)
    submit("small", prompt_len=8, max_tokens=4)
    full.step()
    assert full.describe().waits_for_memory == "urgent"
    assert [s.request.id for s in full.slots if s.request] == ["running"]
    roomy = pooled(redis_client, kv_tokens=512, worker_id="roomy")
    roomy.engine.clock.now_ms = full.engine.clock.now_ms
    roomy.step()
    assert [s.request.id for s in roomy.slots if s.request] == ["urgent", "small"]
    assert claim_order(redis_client, ["urgent", "small"]) == ["urgent", "small"]
    full.step()
    assert full.describe().waits_for_memory == ""
    assert redis_client.hget(K.req("running"), "status") == "running"  # small did not wait for it
    for worker in (full, roomy):
        run_until_idle(worker)
    assert all(redis_client.hget(K.req(r), "status") == "finished" for r in ("running", "urgent", "small"))
    for worker in (full, roomy):
        pool = worker.pool.blocks
        assert pool.num_used == pool.num_reserved == 0 and pool.num_free == pool.num_blocks


def test_a_prefix_read_once_is_shared_by_later_requests_and_recorded(redis_client, submit):
    header = distinct_prompt("header", 64)
    submit("first", prompt=header + [7, 8, 9], max_tokens=3)
    worker = pooled(redis_client, kv_tokens=1024)
    run_until_idle(worker)
    assert redis_client.hget(K.req("first"), "cached_tokens") == "0"
    # two more with the same 64-token header: each reads only what follows it
    submit("second", prompt=header + [1, 2], max_tokens=3)
    submit("third", prompt=header + [3, 4, 5], max_tokens=3)
    worker.read_log.clear()
    worker.step()
    assert worker.pool.blocks.num_shared == 4  # the header's 4 blocks, held by both slots
    run_until_idle(worker)
    assert sorted(worker.read_log) == [("second", 2), ("third", 3)]
    for rid in ("second", "third"):
        assert redis_client.hget(K.req(rid), "cached_tokens") == "64"
    assert worker.describe().blocks_cached >= 4


def test_a_request_that_can_never_fit_fails_instead_of_waiting(redis_client, submit):
    # past the door's checks (a request enqueued for a bigger worker): it fails at once, naming both numbers
    submit("huge", prompt_len=100, max_tokens=100)
    submit("after", prompt_len=8, max_tokens=2)
    worker = pooled(redis_client, kv_tokens=128)
    run_until_idle(worker)
    h = redis_client.hgetall(K.req("huge"))
    assert h["status"] == "failed"
    error = [f for _, f in redis_client.xrange(K.out("huge"))][-1]
    assert error["code"] == "context_length_exceeded"
    assert "128" in error["message"] and "200" in error["message"]
    assert redis_client.hget(K.req("after"), "status") == "finished"


def test_n_answers_share_the_reads_full_blocks(redis_client, submit):
    # 3 answers of a 40-token prompt: the read's two full blocks are held by all three slots, each
    # answer keeps its own partial block and what it generates; all given back at the end
    submit("three", prompt=distinct_prompt("n", 40), max_tokens=20, n=3, seed=1, temperature=0.8)
    worker = pooled(redis_client, kv_tokens=512)
    while not any(s.request and s.phase.name == "DECODING" for s in worker.slots):
        worker.step()
    pool = worker.pool.blocks
    assert pool.num_shared == 2
    assert [len(pool.tables[i].blocks) for i in range(3)] == [3, 3, 3]
    assert len({b for i in range(3) for b in pool.tables[i].blocks}) == 2 + 3  # 2 shared, 3 own
    assert all(worker.engine.tables[i] == pool.tables[i].blocks for i in range(3))
    run_until_idle(worker)
    assert redis_client.hget(K.req("three"), "status") == "finished"
    assert pool.num_used == pool.num_reserved == 0


def test_a_read_gives_way_on_the_pool_and_keeps_its_blocks_while_parked(redis_client, submit):
    # 144 blocks of 16: both 1000-token reads fit (63 + 1 blocks each); the parked read's blocks
    # stay its own while the urgent one reads into others, and it resumes where it parked
    submit("long", priority=0, prompt_len=1000, max_tokens=8)
    worker = pooled(redis_client, kv_tokens=2304, slots=2, chunk=96)
    worker.step()
    parked = list(worker.engine.tables[0])
    assert len(parked) >= 6  # its first 96 tokens' blocks, at least
    submit("urgent", priority=5, prompt_len=1000, max_tokens=8)
    worker.step()
    worker.step()
    assert [s.request.id if s.request else None for s in worker.slots] == ["long", "urgent"]
    assert worker.engine.tables[0][:len(parked)] == parked  # kept while parked
    assert not set(worker.engine.tables[0]) & set(worker.engine.tables[1])  # the newcomer's blocks are others
    run_until_idle(worker)
    assert worker.read_log[:2] == [("long", 96), ("urgent", 96)]
    assert sum(n for rid, n in worker.read_log if rid == "long") == 1000  # no recompute
    long = redis_client.hgetall(K.req("long"))
    assert (long["yields"], long["gave_way_to"], long["status"]) == ("1", "urgent", "finished")
    pool = worker.pool.blocks
    assert pool.num_used == pool.num_reserved == 0 and pool.num_free == pool.num_blocks


def test_a_worker_killed_mid_read_leaves_the_request_to_another_which_reads_it_on_its_own_pool(redis_client, submit):
    prompt = distinct_prompt("killed", 100)
    submit("solo", prompt=prompt, max_tokens=6)
    ref = pooled(redis_client, kv_tokens=256, slots=1, worker_id="ref")
    run_until_idle(ref)
    ref.stop()  # gone from the fleet: not an idle worker holding the prefix that "a" is left to
    reference = [e for e in stream(redis_client, "solo") if e["type"] == "token"]

    submit("a", prompt=prompt, max_tokens=6)
    dying = pooled(redis_client, kv_tokens=256, slots=1, worker_id="dying")
    dying.step()
    dying.step()  # two chunks of 16 read, no token yet; then the process "dies"
    assert dying.read_log == [("a", 16), ("a", 16)] and not stream(redis_client, "a")
    heir = pooled(redis_client, kv_tokens=256, slots=1, worker_id="heir")
    heir.engine.clock.now_ms = dying.engine.clock.now_ms + 5_000  # past the lease
    run_until_idle(heir)
    assert sum(n for _, n in heir.read_log) == 100  # its own pool held nothing: the whole prompt
    assert [e for e in stream(redis_client, "a") if e["type"] == "token"] == reference
    assert redis_client.hget(K.req("a"), "attempts") == "2"
    assert redis_client.hget(K.req("a"), "status") == "finished"
    pool = heir.pool.blocks
    assert pool.num_used == pool.num_reserved == 0 and pool.num_free == pool.num_blocks


def tokens_of(redis_client, rid):
    return [e for e in stream(redis_client, rid) if e["type"] == "token"]


def cold_answers(redis_client, submit, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list]:
    """Each prompt's answer read alone on a fresh pool of its own (a worker of one slot)."""
    answers = {}
    for rid, prompt in prompts.items():
        submit(f"cold-{rid}", prompt=prompt, max_tokens=max_tokens)
        cold = pooled(redis_client, kv_tokens=1024, slots=1, worker_id=f"cold-{rid}")
        run_until_idle(cold)
        cold.stop()  # gone from the fleet: not an idle worker the next one leaves newcomers to
        answers[rid] = tokens_of(redis_client, f"cold-{rid}")
    return answers


def test_two_requests_with_one_new_prefix_arriving_together_read_it_once(redis_client, submit):
    # nothing cached when both are admitted in one step: the first reads the 64-token header, the
    # second, taking the lines after it, adopts the header's 4 blocks and reads only its question
    header = distinct_prompt("new-header", 64)
    prompts = {"a": header + [7, 8, 9], "b": header + [1, 2]}
    cold = cold_answers(redis_client, submit, prompts, max_tokens=4)
    for rid, prompt in prompts.items():
        submit(rid, prompt=prompt, max_tokens=4)
    worker = pooled(redis_client, kv_tokens=1024)
    worker.step()
    assert sorted(s.request.id for s in worker.slots if s.request) == ["a", "b"]  # one step's admissions
    assert worker.pool.cached_tokens(1) == 0  # b found nothing cached when admitted
    run_until_idle(worker)
    assert worker.read_log == [("a", 16)] * 4 + [("a", 3), ("b", 2)]
    assert worker.prompt_tokens_read == 64 + 3 + 2
    assert (redis_client.hget(K.req("a"), "cached_tokens"), redis_client.hget(K.req("b"), "cached_tokens")) == ("0", "64")
    for rid in prompts:
        assert tokens_of(redis_client, rid) == cold[rid]
        assert redis_client.hget(K.req(rid), "status") == "finished"
    pool = worker.pool.blocks
    assert pool.num_used == pool.num_reserved == 0 and pool.num_free == pool.num_blocks


def test_a_new_prefix_is_read_once_across_a_give_way(redis_client, submit):
    # a reads the first half of a new header, gives way to an urgent request with the same header:
    # the urgent one adopts that half and reads the rest; a, back on the lines, adopts the rest
    header = distinct_prompt("gw-header", 64)
    prompts = {"a": header + [7, 8, 9], "urgent": header + [1, 2]}
    cold = cold_answers(redis_client, submit, prompts, max_tokens=4)
    submit("a", prompt=prompts["a"], max_tokens=4)
    worker = pooled(redis_client, kv_tokens=1024, slots=2)
    worker.step()
    worker.step()
    submit("urgent", priority=5, prompt=prompts["urgent"], max_tokens=4)
    run_until_idle(worker)
    assert worker.read_log == [("a", 16), ("a", 16), ("urgent", 16), ("urgent", 16), ("urgent", 2), ("a", 3)]
    assert redis_client.hget(K.req("a"), "yields") == "1"
    assert redis_client.hget(K.req("urgent"), "cached_tokens") == "32"
    assert redis_client.hget(K.req("a"), "cached_tokens") == "32"  # the half urgent read for it
    for rid in prompts:
        assert tokens_of(redis_client, rid) == cold[rid]


def test_a_read_cancelled_half_way_leaves_the_other_to_read_the_rest(redis_client, submit, redis_url):
    # nothing waits on blocks not yet written: the second adopts what the cancelled read keyed
    import asyncio

    import redis.asyncio as aioredis

    from queues.intake import Intake
    from tests.helpers.queue import MODEL as QUEUE_MODEL

    header = distinct_prompt("cancel-header", 64)
    cold = cold_answers(redis_client, submit, {"b": header + [1, 2]}, max_tokens=4)
    submit("a", prompt=header + [7, 8, 9], max_tokens=4)
    submit("b", prompt=header + [1, 2], max_tokens=4)
    worker = pooled(redis_client, kv_tokens=1024)
    worker.step()
    worker.step()  # a has read 32 tokens of the header

    async def cancel() -> None:
        client = aioredis.Redis.from_url(redis_url)
        await Intake(client, QUEUE_MODEL).cancel("a")
        await client.aclose()

    asyncio.run(cancel())
    run_until_idle(worker)
    assert redis_client.hget(K.req("a"), "status") == "cancelled"
    # a read a third chunk in the step the cancel was seen; b reads the header's last block, its question
    assert [n for rid, n in worker.read_log if rid == "a"] == [16, 16, 16]
    assert [n for rid, n in worker.read_log if rid == "b"] == [16, 2]
    assert redis_client.hget(K.req("b"), "cached_tokens") == "48"
    assert tokens_of(redis_client, "b") == cold["b"]
