"""The worker's torch threads spin briefly, then sleep, when they wait (docs/engine.md: long
spinning crawls when anything else runs on the cores, sleeping at once halves a quiet step)."""

from __future__ import annotations

import os
import subprocess
import sys

SHOW = "import os, sys, engine.runner; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"


def run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_importing_the_engine_bounds_openmp_spinning_before_torch_loads():
    assert run(SHOW) == "PASSIVE 2000"
    assert run("import engine, sys; print('torch' in sys.modules)") == "False"  # set before torch, not after


def test_an_explicit_policy_or_spin_count_wins():
    assert run(SHOW, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None"
    assert run(SHOW, OMP_WAIT_POLICY="PASSIVE") == "PASSIVE None"  # sleep at once: no spin count added
    assert run(SHOW, GOMP_SPINCOUNT="200000") == "None 200000"
