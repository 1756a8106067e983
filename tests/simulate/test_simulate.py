"""The simulator: the same seed gives the same outcome, it schedules exactly as the worker-loop
tests do on their traces, and the command reads its flags and files like every other."""

from __future__ import annotations

import json

import pytest

from engine.cost_profile import CostGrid, CostProfile
from queues.keys import Keys
from simulate import fleet
from simulate.main import simulate
from simulate.settings import SimulateSettings
from simulate.workload import Arrival
from tests.helpers.workers import MODEL, make_worker
from workers.settings import WorkerSettings

# the fake engine's flat costs as a profile: 1 ms per prompt token, 10 ms per decode step
FLAT = CostProfile(read=CostGrid([0, 1000], [1, 100], [[1.0, 100.0], [1.0, 100.0]]),
                   decode=CostGrid([1, 2], [1, 2], [[10.0, 10.0], [10.0, 10.0]]))

WORKLOAD = """
duration_s: 20
seed: 5
classes:
  - {name: alerts, priority: 10, rate_per_s: 0.5, prompt_tokens: 30, max_tokens: 8}
  - {name: chat, priority: 0, rate_per_s: 3, prompt_tokens: {dist: lognormal, median: 300, sigma: 0.8, max: 1500},
     max_tokens: {dist: uniform, low: 10, high: 120}}
  - {name: battery, priority: -5, rate_per_s: 2, prompt_tokens: 200, max_tokens: 100, queue_timeout_s: 5}
"""


def settings(tmp_path, **kw) -> SimulateSettings:
    (tmp_path / "w.yaml").write_text(WORKLOAD)
    FLAT.save(tmp_path / "flat.json")
    return SimulateSettings(workload=tmp_path / "w.yaml", profile=tmp_path / "flat.json", workers=2, parallel=2,
                            prefill_chunk=64, **kw)


def runs_of(result: dict) -> list[dict]:
    for run in result["runs"]:
        for name in ("wall_s", "speed_x", "cpu_s", "redis_cpu_s"):
            run["totals"].pop(name)
    return result["runs"]


def test_the_same_seed_gives_the_same_outcome_twice_and_another_seed_another(tmp_path):
    first = runs_of(simulate(settings(tmp_path)))
    assert first == runs_of(simulate(settings(tmp_path)))
    levels = {lv["priority"]: lv for lv in first[0]["priorities"]}
    assert set(levels) == {10, 0, -5}
    assert all(lv["unfinished"] == 0 for lv in levels.values())
    assert first[0]["totals"]["simulated_s"] < 300  # it stops once all is served (the cut-off is an hour on)
    assert levels[10]["ttft_s"]["p50"] < levels[0]["ttft_s"]["p50"]  # the alerts go first
    assert levels[-5]["expired"] > 0 and levels[0]["give_ways"] > 0  # an overloaded fleet: both happen
    assert runs_of(simulate(settings(tmp_path, seed=6))) != first
    assert runs_of(simulate(settings(tmp_path, exact_reports=True))) == first  # every call production makes: same


def test_compare_replays_the_same_arrivals_and_writes_the_summary_and_plots(tmp_path):
    result = simulate(settings(tmp_path, compare=["ignore_priority=true"], out=tmp_path / "out"))
    with_priority, without = result["runs"]
    assert "priorities ignored" in without["config"]
    arrived = lambda run: {lv["priority"]: lv["arrived"] for lv in run["priorities"]}  # noqa: E731
    assert arrived(with_priority) == arrived(without)
    p99 = lambda run, p: next(lv for lv in run["priorities"] if lv["priority"] == p)["ttft_s"]["p99"]  # noqa: E731
    assert p99(with_priority, 10) < p99(without, 10)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["runs"][1]["config"] == without["config"]
    for png in ("ttft_cdf.png", "queue_length.png"):
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG"


# The traces of tests/workers/test_give_way.py and test_loop.py: (arrival ms, id, priority, prompt
# tokens, max tokens), slots, chunk. The reference drives make_worker by hand as those tests do.
TRACES = {
    "a long read gives way": ([(0, "long", 0, 1000, 3), (100, "urgent", 5, 1000, 3)], 2, 100),
    "no way to a shorter lower priority": ([(0, "long", 5, 1000, 3), (100, "short", 0, 3, 3)], 2, 100),
    "half as long": ([(0, "long", 0, 1000, 3), (100, "half", 0, 500, 3), (200, "under", 0, 499, 3)], 3, 100),
    "slot by priority then arrival": ([(0, "busy", 0, 4, 50)] + [(4, f"r{i}", p, 4, 3) for i, p in enumerate([0, 5, 0, 9, 5])],
                                      1, 8),
}
FIELDS = ("claim_seq", "claimed_ms", "first_token_ms", "finished_ms", "yields", "completion_tokens", "status")


def reference(redis_client, submit, trace, slots: int, chunk: int) -> dict[str, dict]:
    worker = make_worker(redis_client, slots=slots, chunk=chunk)
    pending = list(trace)
    while True:
        while pending and pending[0][0] <= worker.clock():
            _, rid, priority, prompt, answer = pending.pop(0)
            submit(rid, priority, prompt_len=prompt, max_tokens=answer)
        if not worker.step():
            if not pending:
                break
            worker.engine.clock.now_ms = pending[0][0]
    return {rid: {f: redis_client.hget(Keys(MODEL).req(rid), f) or "0" for f in FIELDS} for _, rid, *_ in trace}


@pytest.mark.parametrize("exact", [True, False], ids=["exact reports", "fast reports"])
@pytest.mark.parametrize("name", list(TRACES))
def test_the_simulator_schedules_exactly_as_the_worker_loop_tests(redis_client, submit, name, exact):
    trace, slots, chunk = TRACES[name]
    expected = reference(redis_client, submit, trace, slots, chunk)
    redis_client.flushdb()
    arrivals = [Arrival(rid, at, priority, prompt, answer, None, "t") for at, rid, priority, prompt, answer in trace]
    outcome = fleet.run(arrivals, redis_client, WorkerSettings(parallel=slots, prefill_chunk=chunk), FLAT,
                        exact_reports=exact)
    got = {rid: {f: outcome.records[rid].get(f, "0") for f in FIELDS} for _, rid, *_ in trace}
    assert got == expected


def test_the_command_names_the_field_of_a_bad_workload_and_a_missing_profile(tmp_path, capsys):
    from strata.cli import main

    (tmp_path / "w.yaml").write_text("classes:\n  - {name: a, rate_per_s: 0, prompt_tokens: 5, max_tokens: 5}\n")
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(tmp_path / "w.yaml"), "--profile", str(tmp_path / "none.json")])
    assert "classes.0.rate_per_s: Input should be greater than 0" in str(exit_.value)
    (tmp_path / "w.yaml").write_text(WORKLOAD)
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(tmp_path / "w.yaml"), "--profile", str(tmp_path / "none.json")])
    assert "none.json: cannot read it" in str(exit_.value) and "strata calibrate" in str(exit_.value)
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(tmp_path / "w.yaml"), "--compare", "nonsense"])
    # a bad flag is a configuration that cannot work: one line on stderr, exit code 2
    assert exit_.value.code == 2
    assert "--compare 'nonsense'" in capsys.readouterr().err


def test_the_loop_s_step_overhead_is_charged_once_per_busy_step(redis_client):
    """One request read in one step then decoded in four: 5 busy steps, each 3 ms later."""
    arrivals = [Arrival("one", 0, 0, 4, 5, None, "t")]
    times = {}
    for overhead in (0.0, 3.0):
        redis_client.flushdb()
        profile = CostProfile(FLAT.read, FLAT.decode, step_overhead_ms=overhead)
        record = fleet.run(arrivals, redis_client, WorkerSettings(parallel=1, prefill_chunk=8), profile).records["one"]
        times[overhead] = (int(record["first_token_ms"]), int(record["finished_ms"]), record["completion_tokens"])
    assert times[0.0] == (4, 4 + 4 * 10, "5")  # a 4-token read, then four 10 ms decode steps
    assert times[3.0] == (3 + 4, 3 + 4 + 4 * (3 + 10), "5")


def _ttft(outcome, rid: str) -> int:
    record = outcome.records[rid]
    return int(record["first_token_ms"]) - int(record["enqueued_ms"])


def test_the_simulated_pool_serves_a_shared_prefix_from_its_cached_blocks(redis_client):
    # one request reads a 1 500-token header; two more with it, arriving together later, read
    # only what follows the header's last full 64-token block (1 472 tokens cached)
    arrivals = [Arrival(rid, at, 0, 1570, 4, None, "agent", 1500, 0)
                for rid, at in (("first", 0), ("second", 20_000), ("third", 20_000))]
    outcome = fleet.run(arrivals, redis_client, WorkerSettings(parallel=2, prefill_chunk=256), FLAT)
    first = _ttft(outcome, "first")
    assert first >= 1570  # 1 ms a prompt token, read whole
    for rid in ("second", "third"):
        assert _ttft(outcome, rid) <= 0.3 * first, (rid, _ttft(outcome, rid), first)
    # without the header shared, each reads its whole prompt
    redis_client.flushdb()
    alone = [Arrival(a.id, a.at_ms, 0, 1570, 4, None, "agent") for a in arrivals]
    outcome = fleet.run(alone, redis_client, WorkerSettings(parallel=2, prefill_chunk=256), FLAT)
    assert all(_ttft(outcome, a.id) >= 1570 for a in alone)


def test_the_simulated_pool_admits_by_memory_and_a_waiting_head_is_not_overtaken(redis_client):
    # 16 blocks of 64: two running requests reserve 6 each; the urgent one needs 9 and waits for
    # one to end; a small one behind it would fit in the 4 left but does not overtake it
    arrivals = [Arrival("a", 0, 0, 300, 60, None, "t"), Arrival("b", 0, 0, 300, 60, None, "t"),
                Arrival("urgent", 100, 9, 500, 20, None, "t"), Arrival("small", 200, 0, 50, 10, None, "t")]
    outcome = fleet.run(arrivals, redis_client, WorkerSettings(parallel=4, prefill_chunk=256, kv_tokens=1024), FLAT)
    r = outcome.records
    assert all(r[rid]["status"] == "finished" for rid in ("a", "b", "urgent", "small"))
    assert int(r["urgent"]["claimed_ms"]) >= min(int(r["a"]["finished_ms"]), int(r["b"]["finished_ms"]))
    assert int(r["small"]["claim_seq"]) > int(r["urgent"]["claim_seq"])
    # with room for all (the default pool, --parallel x --ctx) nobody waits for memory
    redis_client.flushdb()
    outcome = fleet.run(arrivals, redis_client, WorkerSettings(parallel=4, prefill_chunk=256), FLAT)
    assert int(outcome.records["urgent"]["claimed_ms"]) < int(outcome.records["a"]["finished_ms"])
