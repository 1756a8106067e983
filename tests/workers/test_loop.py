"""The worker loop over the fake engine and a real Redis: exact, no sleeps."""

from __future__ import annotations

import pytest

from engine.errors import RowsFailed
from engine.fake import FakeEngine
from engine.grammar import GrammarError
from queues.claims import Claims
from queues.keys import Keys
from tests.helpers.queue import distinct_prompt
from tests.helpers.workers import MODEL, make_worker, run_until_idle
from workers.loop import Worker

K = Keys(MODEL)


def stream(redis_client, rid):
    return [f for _, f in redis_client.xrange(K.out(rid))]


def test_a_request_runs_to_max_tokens_and_frees_its_slot(redis_client, submit):
    submit("a", prompt_len=20, max_tokens=5)
    worker = make_worker(redis_client, chunk=8)
    run_until_idle(worker)
    events = stream(redis_client, "a")
    assert [e["type"] for e in events] == ["token"] * 5 + ["done"]
    assert events[-1] == {"type": "done", "finish_reason": "length", "prompt_tokens": "20", "completion_tokens": "5"}
    reads = [c.tokens for c in worker.engine.calls if c.kind == "read"]
    assert reads == [8, 8, 4]  # the prompt read in chunks
    h = redis_client.hgetall(K.req("a"))
    assert h["status"] == "finished" and int(h["first_token_ms"]) <= int(h["finished_ms"])
    assert h["first_token_ms"] == "20"  # virtual ms: 20 prompt tokens at 1 ms, the first token at the read's end
    assert all(s.is_free for s in worker.slots)
    assert redis_client.zcard(K.running) == 0


def test_with_one_slot_busy_the_slot_goes_by_priority_then_arrival(redis_client, submit):
    submit("busy", max_tokens=50)
    worker = make_worker(redis_client, slots=1)
    worker.step()
    assert worker.slots[0].request.id == "busy"
    for i, priority in enumerate([0, 5, 0, 9, 5]):
        submit(f"r{i}", priority)
    run_until_idle(worker)
    order = sorted(["r0", "r1", "r2", "r3", "r4"], key=lambda r: int(redis_client.hget(K.req(r), "claim_seq")))
    assert order == ["r3", "r1", "r4", "r0", "r2"]  # 9, 5, 5, 0, 0


def test_batch_and_solo_give_the_same_tokens(redis_client, submit):
    prompt = distinct_prompt("shared", 10)
    submit("solo", prompt=prompt, max_tokens=6)
    run_until_idle(make_worker(redis_client, slots=4))
    solo = stream(redis_client, "solo")
    for rid in ("x", "same", "y"):
        submit(rid, prompt=prompt if rid == "same" else None, prompt_len=7, max_tokens=6)
    run_until_idle(make_worker(redis_client, slots=4, worker_id="w2"))
    assert stream(redis_client, "same") == solo


def test_stop_string_ends_the_answer_and_is_not_sent(redis_client, submit):
    prompt = distinct_prompt("shared", 3)
    submit("free", prompt=prompt, max_tokens=6)
    run_until_idle(make_worker(redis_client))
    full = "".join(e.get("text", "") for e in stream(redis_client, "free"))
    third = full.split(" ")[3]  # " t.. t.. t.." -> the third token's text
    submit("stopped", prompt=prompt, max_tokens=6, stop=[" " + third])
    run_until_idle(make_worker(redis_client, worker_id="w2"))
    events = stream(redis_client, "stopped")
    text = "".join(e.get("text", "") for e in events)
    assert text == full[: full.index(" " + third)]
    assert events[-1]["finish_reason"] == "stop" and events[-1]["completion_tokens"] == "3"


def test_a_cancelled_request_frees_its_slot_within_one_step(redis_client, submit, redis_url):
    import asyncio

    import redis.asyncio as aioredis

    from queues.intake import Intake

    submit("a", max_tokens=1000)
    worker = make_worker(redis_client, slots=1)
    worker.step()
    worker.step()

    async def cancel() -> None:
        client = aioredis.Redis.from_url(redis_url)
        await Intake(client, MODEL).cancel("a")
        await client.aclose()

    asyncio.run(cancel())
    worker.step()
    assert worker.slots[0].is_free
    assert redis_client.hget(K.req("a"), "status") == "cancelled"


def test_a_dead_workers_request_resumes_after_the_tokens_it_streamed(redis_client, submit):
    prompt = distinct_prompt("shared", 5)
    submit("solo", prompt=prompt, max_tokens=8)
    run_until_idle(make_worker(redis_client, worker_id="ref"))
    reference = [e for e in stream(redis_client, "solo") if e["type"] == "token"]

    submit("a", prompt=prompt, max_tokens=8)
    dying = make_worker(redis_client, slots=1, worker_id="dying")
    for _ in range(4):
        dying.step()  # 4 tokens streamed (the read samples the first), then the process "dies"
    streamed = [e for e in stream(redis_client, "a") if e["type"] == "token"]
    assert len(streamed) == 4

    engine = FakeEngine(num_slots=1)
    engine.clock.now_ms = dying.engine.clock.now_ms + 5_000  # past the lease
    heir = Worker(engine, Claims(redis_client, MODEL, "heir", lease_ms=1000), engine.tokenizer,
                  prefill_chunk=8, clock=engine.clock)
    run_until_idle(heir)
    events = stream(redis_client, "a")
    assert [e for e in events if e["type"] == "token"] == reference  # the client's stream just continues
    assert events[-1]["completion_tokens"] == "8"
    assert redis_client.hget(K.req("a"), "attempts") == "2"
    # a sampled request's random stream goes on after the 4 draws the dead worker made
    assert engine._params[0].already_sampled == 4


def test_a_clean_stop_hands_requests_back_and_another_worker_finishes_them(redis_client, submit):
    submit("a", prompt_len=5, max_tokens=6)
    first = make_worker(redis_client, slots=1, worker_id="first")
    first.step()
    first.step()
    first.stop()
    assert redis_client.hget(K.req("a"), "status") == "waiting"
    assert not redis_client.exists(K.worker("first"))
    run_until_idle(make_worker(redis_client, slots=1, worker_id="second"))
    events = stream(redis_client, "a")
    assert sum(e["type"] == "token" for e in events) == 6 and events[-1]["type"] == "done"


def test_the_worker_hash_shows_slots_and_the_current_read(redis_client, submit):
    submit("long", priority=3, prompt_len=40)
    worker = make_worker(redis_client, slots=2, chunk=8)
    worker.step()
    worker.upkeep.run(worker.clock(), worker.describe())
    h = redis_client.hgetall(K.worker("w1"))
    assert (h["slots_total"], h["slots_busy"], h["reading"]) == ("2", "1", "long")
    assert (h["reading_priority"], h["reading_prompt_tokens"], h["reading_progress"]) == ("3", "40", "8")
    assert redis_client.ttl(K.worker("w1")) > 0


def test_the_worker_hash_says_how_decode_steps_run_while_the_compiled_step_builds(redis_client):
    from engine.protocol import DecodePath
    from queues.worker_state import WorkerState

    worker = make_worker(redis_client, slots=2, path=DecodePath("compiling", 40))
    worker.upkeep.run(worker.clock(), worker.describe())
    h = redis_client.hgetall(K.worker("w1"))
    assert (h["decode_step"], h["compile_progress"]) == ("compiling", "40")
    assert WorkerState.from_hash(h).decode_step_words() == "compiling the decode step, serving eager meanwhile: 40 %"
    worker.engine.path = DecodePath("compiled")
    worker.upkeep.run(worker.clock() + 5000, worker.describe())
    assert redis_client.hget(K.worker("w1"), "decode_step") == "compiled"


def test_a_conversation_continues_in_the_slot_that_holds_its_prefix(redis_client, submit):
    submit("turn1", prompt_len=10, max_tokens=3)
    worker = make_worker(redis_client, slots=2, chunk=64)
    run_until_idle(worker)
    answer = [int(e["ids"]) for e in stream(redis_client, "turn1") if e["type"] == "token"]
    turn2 = distinct_prompt("turn1", 10) + answer + [50, 51]
    submit("turn2", prompt=turn2, max_tokens=4)
    run_until_idle(worker)
    assert redis_client.hget(K.req("turn2"), "slot") == redis_client.hget(K.req("turn1"), "slot")
    # the slot kept turn 1's prompt (10 of 15); turn 1's answer is read again as prompt tokens: its
    # entries came from decode steps, and a worker reading turn 2 from scratch reads it as a prompt
    assert worker.read_log[-1] == ("turn2", 5)
    submit("fresh", prompt=turn2, max_tokens=4)
    run_until_idle(make_worker(redis_client, slots=2, chunk=64, worker_id="w2"))
    assert stream(redis_client, "fresh") == stream(redis_client, "turn2")  # same answer as read from scratch


class ManyAStep(FakeEngine):
    """Every decode step confirms its guesses: each slot gets its next `per_step` tokens (those of
    as many steps), all but the last already in its cache, as the real engine's prompt lookup does."""

    per_step = 2

    def decode(self, slots, tokens):  # noqa: ANN001
        out = super().decode(slots, tokens)
        for slot, new in zip(slots, out):
            for _ in range(self.per_step - 1):
                self._cache[slot].append(new[-1])
                new.append(self._next(slot))
        return out


class FourAStep(ManyAStep):
    per_step = 4  # three guesses after a run of four, all right


@pytest.mark.parametrize("engine_type", [ManyAStep, FourAStep], ids=["two", "four"])
def test_several_tokens_a_step_stream_as_one_step_each(redis_client, submit, engine_type):
    prompt = distinct_prompt("two", 9)
    submit("one", prompt=prompt, max_tokens=6)
    run_until_idle(make_worker(redis_client))
    one = stream(redis_client, "one")
    # the read's token, then per_step a step (2 + 2 + 2, or 4 + 4): what passes max_tokens is dropped
    submit("two", prompt=prompt, max_tokens=6)
    worker = make_worker(redis_client, worker_id="w2", engine_type=engine_type)
    run_until_idle(worker)
    assert stream(redis_client, "two") == one
    assert one[-1] == {"type": "done", "finish_reason": "length", "prompt_tokens": "9", "completion_tokens": "6"}
    steps = -(-5 // engine_type.per_step)
    assert [c.kind for c in worker.engine.calls].count("decode") == steps
    # the cache holds the prompt and every token the steps fed (past max_tokens too); a next
    # request may keep only the prompt's entries (the answer's came from decode steps, which a
    # prompt read cold would not reproduce)
    assert worker.engine.position(0) == 9 + steps * engine_type.per_step
    assert worker.engine._cache[0][:9 + 6] == prompt + [int(e["ids"]) for e in one[:-1]]
    assert worker.slots[0].cached == prompt
    # a stop string on the first of a step's tokens: the others never stream
    full = "".join(e.get("text", "") for e in one)
    fourth = full.split(" ")[4]  # the first of the second step's two; the last of the first step's four
    submit("stopped", prompt=prompt, max_tokens=6, stop=[" " + fourth])
    run_until_idle(make_worker(redis_client, worker_id="w3", engine_type=engine_type))
    events = stream(redis_client, "stopped")
    assert "".join(e.get("text", "") for e in events) == full[: full.index(" " + fourth)]
    assert events[-1]["finish_reason"] == "stop" and events[-1]["completion_tokens"] == "4"


class GrammarDeadEnd(FakeEngine):
    """A request whose grammar is "dead end" fails in its second decode step (its grammar left no
    token), as the real engine reports it: the other rows' tokens beside the failure."""

    def begin(self, slot, params, keep=0):  # noqa: ANN001
        super().begin(slot, params, keep)
        self._steps = getattr(self, "_steps", {}) | {slot: 0}

    def decode(self, slots, tokens):  # noqa: ANN001
        doomed = [s for s in slots if self._params[s].grammar == "dead end" and self._steps[s] == 1]
        for slot in slots:
            self._steps[slot] += 1
        if not doomed:
            return super().decode(slots, tokens)
        kept = [(s, t) for s, t in zip(slots, tokens) if s not in doomed]
        out = super().decode([s for s, _ in kept], [t for _, t in kept]) if kept else []
        raise RowsFailed({s: new for (s, _), new in zip(kept, out)},
                         {s: GrammarError("the grammar allows no token here") for s in doomed})


def test_a_grammar_that_fails_ends_only_its_own_request(redis_client, submit):
    prompt = distinct_prompt("beside", 6)
    submit("solo", prompt=prompt, max_tokens=6)
    run_until_idle(make_worker(redis_client, worker_id="ref"))
    submit("doomed", prompt_len=5, max_tokens=6, grammar="dead end")
    submit("beside", prompt=prompt, max_tokens=6)
    worker = make_worker(redis_client, engine_type=GrammarDeadEnd)
    run_until_idle(worker)
    events = stream(redis_client, "doomed")
    assert [e["type"] for e in events] == ["token", "token", "error"]  # the read's token, one step's, the end
    assert events[-1]["code"] == "grammar_error" and "allows no token" in events[-1]["message"]
    assert redis_client.hget(K.req("doomed"), "status") == "failed"
    assert stream(redis_client, "beside") == stream(redis_client, "solo")  # untouched, token for token
    assert redis_client.hget(K.req("beside"), "status") == "finished"
    assert all(s.is_free for s in worker.slots) and redis_client.zcard(K.running) == 0
