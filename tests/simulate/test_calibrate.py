"""`strata calibrate --quick` on a tiny random model: it times the real engine through its
public interface and writes a profile the simulator loads."""

from __future__ import annotations

from engine.cost_profile import CostProfile
from strata.cli import main


def test_calibrate_quick_writes_a_profile_the_fake_engine_can_use(tiny_model, tmp_path):
    out = tmp_path / "profile.json"
    main(["calibrate", "--quick", "--model", str(tiny_model), "--parallel", "2", "--ctx", "256",
          "--dtype", "float32", "--threads", "1", "--out", str(out)])
    profile = CostProfile.load(out)
    assert profile.read.rows == [0, 64] and profile.read.columns == [8, 32]
    assert profile.decode.rows == [1, 2] and profile.decode.columns == [16, 64]
    assert all(ms > 0 for row in profile.read.ms + profile.decode.ms for ms in row)
    assert profile.machine["plan"] == "quick" and profile.machine["slots"] == "2"
    assert profile.read_ms(0, 8) > 0 and profile.decode_ms(2, 64) > 0
    assert profile.step_overhead_ms > 0  # the worker loop timed over a free engine against a real Redis
