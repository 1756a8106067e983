"""The cost profile (engine/cost_profile.py) and the fake engine's profiled mode: what a
simulated read or decode step costs is what the profile says, interpolated between its points."""

from __future__ import annotations

import json

import pytest

from engine.cost_profile import CostGrid, CostProfile
from engine.fake import FakeEngine
from engine.protocol import SamplingParams

PROFILE = CostProfile(
    read=CostGrid(rows=[0, 1000], columns=[100, 200], ms=[[10.0, 20.0], [30.0, 60.0]]),
    decode=CostGrid(rows=[1, 4], columns=[100, 1100], ms=[[20.0, 40.0], [50.0, 90.0]]),
    machine={"device": "test"},
    step_overhead_ms=2.5,
)


def test_costs_interpolate_between_points_and_follow_the_last_segment_beyond():
    assert PROFILE.read_ms(0, 100) == 10.0
    assert PROFILE.read_ms(500, 150) == pytest.approx((15.0 + 45.0) / 2)
    assert PROFILE.read_ms(0, 300) == pytest.approx(30.0)  # extended: +10 ms per 100 tokens
    assert PROFILE.decode_ms(2, 600) == pytest.approx(30.0 + (70.0 - 30.0) / 3)  # 1 row: 30, 4 rows: 70
    assert PROFILE.decode_ms(1, 0) >= 0


def test_a_profile_survives_a_round_trip_through_its_file(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.save(path)
    assert CostProfile.load(path) == PROFILE


def test_a_profile_written_before_the_step_overhead_loads_with_none(tmp_path):
    path = tmp_path / "old.json"
    data = json.loads(PROFILE.to_json())
    del data["step_overhead_ms"]
    path.write_text(json.dumps(data))
    profile = CostProfile.load(path)
    assert profile.step_overhead_ms == 0.0
    assert profile.read == PROFILE.read and profile.decode == PROFILE.decode


def test_the_fake_engine_charges_the_step_overhead_once_per_busy_step():
    engine = FakeEngine(num_slots=4, profile=PROFILE)
    engine.begin(0, SamplingParams())
    engine.begin(1, SamplingParams())
    engine.read(1, list(range(1, 101)), sample=True)  # no step started (a hand-driven engine): no overhead
    assert engine.clock() == 10
    engine.start_step()  # a read and a decode in one step: the overhead once, before the read
    engine.read(0, list(range(1, 101)), sample=True)
    assert engine.clock.now_ms + engine.clock.carry_ms == pytest.approx(10 + 2.5 + 10)
    engine.decode([0, 1], [5, 6])  # the same step: no overhead again
    after_first = engine.clock.now_ms + engine.clock.carry_ms
    assert after_first == pytest.approx(22.5 + PROFILE.decode_ms(2, 101))
    engine.start_step()  # a decode alone
    engine.decode([0, 1], [7, 8])
    assert engine.clock.now_ms + engine.clock.carry_ms == pytest.approx(after_first + 2.5 + PROFILE.decode_ms(2, 102))
    engine.start_step()  # a step with no engine call (nothing to do) costs nothing
    assert engine.clock.now_ms + engine.clock.carry_ms == pytest.approx(after_first + 2.5 + PROFILE.decode_ms(2, 102))


def test_a_bad_profile_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"format": 1, "read": {"rows": [0], "columns": [1, 2], "ms": [[1]]}, "decode": {}}')
    with pytest.raises(ValueError, match="needs that many values"):
        CostProfile.load(path)


def test_the_fake_engine_charges_the_profiles_costs():
    engine = FakeEngine(num_slots=4, profile=PROFILE)
    engine.begin(0, SamplingParams())
    engine.read(0, list(range(1, 101)), sample=False)  # 100 tokens, nothing cached
    assert engine.clock() == 10
    engine.read(0, list(range(1, 101)), sample=True)  # 100 more with 100 cached: 10 + (30-10)*0.1
    assert engine.clock() == 22
    engine.decode([0], [5])  # one row, context 201
    assert engine.clock.now_ms + engine.clock.carry_ms == pytest.approx(22 + 20 + 20 * 101 / 1000)


def test_without_a_profile_the_flat_costs_are_unchanged():
    engine = FakeEngine(num_slots=2, read_ms_per_token=1.0, decode_ms_per_step=10.0)
    engine.begin(0, SamplingParams())
    engine.read(0, [1, 2, 3], sample=True)
    engine.decode([0], [4])
    assert engine.clock() == 13


def test_the_bundled_profile_loads_and_is_the_default_without_a_calibration(tmp_path, monkeypatch):
    from simulate.settings import SimulateSettings, bundled_profile

    monkeypatch.chdir(tmp_path)  # no data/cost-profile.json here
    assert SimulateSettings(workload=tmp_path / "w.yaml").profile_path() == bundled_profile()
    profile = CostProfile.load(bundled_profile())
    assert profile.decode_ms(4, 200) > profile.decode_ms(1, 200) > 0 and profile.read_ms(0, 256) > profile.read_ms(0, 16)
