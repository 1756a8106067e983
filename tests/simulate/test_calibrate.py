"""`strata calibrate --quick` on a tiny random model: it times the real engine through its
public interface and writes a profile the simulator loads."""

from __future__ import annotations

from engine.cost_profile import CostProfile
from strata.cli import main


def test_calibrate_quick_writes_a_profile_the_fake_engine_can_use(tiny_model, tmp_path):
    out = tmp_path / "profile.json"
    main(["calibrate", "--quick", "--model", str(tiny_model), "--parallel", "2", "--ctx", "256",
          "--dtype", "float32", "--threads", "1", "--no-compile", "--out", str(out)])
    profile = CostProfile.load(out)
    assert profile.read.rows == [0, 64] and profile.read.columns == [8, 32]
    assert profile.decode.rows == [1, 2] and profile.decode.columns == [16, 64]
    assert all(ms > 0 for row in profile.read.ms + profile.decode.ms for ms in row)
    assert profile.machine["plan"] == "quick" and profile.machine["slots"] == "2"
    assert profile.read_ms(0, 8) > 0 and profile.decode_ms(2, 64) > 0
    assert profile.step_overhead_ms > 0  # the worker loop timed over a free engine against a real Redis


def test_calibration_times_steps_without_guesses_and_gives_the_engine_back_as_it_came(tiny_model):
    """A profile prices a step of r rows: prompt lookup's second row (a guess) must not be in a
    one-row step's time. Afterwards the engine guesses again, as it did before."""
    import dataclasses

    from engine.protocol import SamplingParams
    from engine.load import load_engine
    from simulate.calibrate import Plan, calibrate

    engine = load_engine(tiny_model, num_slots=2, ctx=256, dtype="float32", threads=1, compile=False)
    assert engine.prompt_lookup
    steps: list[list[int]] = []  # each model step's slots, one a row
    step = engine._step
    engine._step = lambda slots, tokens, positions, *rest, **named: steps.append(slots) or step(slots, tokens, positions, *rest, **named)
    # a prompt that repeats itself: unless lookup is off, the one-row steps would guess
    calibrate(engine, [5, 6] * 128, dataclasses.replace(Plan.quick(), overhead_steps=0), {})
    assert [len(s) for s in steps].count(1) > 0
    assert all(len(set(s)) == len(s) for s in steps)  # no slot twice in a step: no guess
    assert engine.prompt_lookup
    engine.begin(0, SamplingParams(temperature=0.0))
    engine.read(0, [5, 6, 5, 6, 5], sample=True)
    engine.decode([0], [6])
    assert steps[-1] == [0, 0]  # (5, 6) was followed by 5 before: guessed, a second row for slot 0
