"""A randomized property test: many requests with random priorities, lengths and arrival times
on several workers sharing one Redis and one virtual clock."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.fake import VirtualClock
from queues.keys import Keys
from tests.workers.conftest import MODEL, make_worker

K = Keys(MODEL)

requests = st.lists(
    st.tuples(
        st.integers(-3, 3),  # priority
        st.integers(1, 300),  # prompt length
        st.integers(0, 3000),  # arrival (virtual ms)
        st.integers(1, 6),  # max tokens
    ),
    min_size=1,
    max_size=14,
)


def watch(worker, redis_client, violations: list[str]) -> None:
    """Spies: every decode step carries all decoding slots; every claim takes the queue's head."""
    decode = worker.engine.decode
    claim = worker.claims.claim
    step = worker.step
    decoding_at_start: set[int] = set()

    def checked_step():
        decoding_at_start.clear()
        decoding_at_start.update(s.index for s in worker.slots if s.phase.value == "decoding")
        busy = step()
        if decoding_at_start:
            violations.append(f"slots {sorted(decoding_at_start)} were decoding and got no step")
        return busy

    def checked_decode(slots, tokens):
        if not decoding_at_start <= set(slots):
            violations.append(f"decode step {sorted(slots)} left out {sorted(decoding_at_start - set(slots))}")
        decoding_at_start.clear()
        return decode(slots, tokens)

    def checked_claim(waiting, now_ms):
        head = redis_client.zrange(K.waiting, 0, 0, withscores=True)
        if head and head[0][0] != waiting.member:
            violations.append(f"claimed {waiting.member} while {head[0][0]} (served first) waited")
        if not any(s.is_free for s in worker.slots):
            violations.append(f"claimed {waiting.member} with no free slot")
        return claim(waiting, now_ms)

    worker.step = checked_step
    worker.engine.decode = checked_decode
    worker.claims.claim = checked_claim


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(load=requests, workers=st.integers(1, 3), slots=st.integers(1, 3), chunk=st.sampled_from([16, 64, 128]))
def test_every_request_finishes_in_order_without_leaks_or_pauses(redis_client, submit, load, workers, slots, chunk):
    redis_client.flushdb()
    clock = VirtualClock()
    fleet = [make_worker(redis_client, slots=slots, chunk=chunk, worker_id=f"w{i}", clock=clock) for i in range(workers)]
    violations: list[str] = []
    for worker in fleet:
        watch(worker, redis_client, violations)
    pending = sorted(((arrival, f"r{i}", p, n, m) for i, (p, n, arrival, m) in enumerate(load)), reverse=True)
    for _ in range(20_000):
        while pending and pending[-1][0] <= clock.now_ms:
            _, rid, priority, length, max_tokens = pending.pop()
            submit(rid, priority=priority, prompt_len=length, max_tokens=max_tokens)
        busy = [worker.step() for worker in fleet]
        if not any(busy):
            if not pending:
                break
            clock.now_ms = max(clock.now_ms, pending[-1][0])
    assert violations == []
    for i, (_p, _n, _a, max_tokens) in enumerate(load):
        h = redis_client.hgetall(K.req(f"r{i}"))
        assert (h["status"], h["completion_tokens"]) == ("finished", str(max_tokens))
    assert redis_client.zcard(K.waiting) == 0 and redis_client.zcard(K.running) == 0
    assert all(s.is_free for worker in fleet for s in worker.slots)
