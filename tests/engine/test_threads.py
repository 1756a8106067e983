"""The worker's torch threads sleep when they wait (docs/engine.md: spinning waiters crawl when
anything else runs on the cores)."""

from __future__ import annotations

import os
import subprocess
import sys


def run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_importing_the_engine_makes_openmp_waiters_passive_before_torch_loads():
    code = "import sys, os, engine.runner; print(os.environ['OMP_WAIT_POLICY'])"
    assert run(code) == "PASSIVE"
    assert run("import engine, sys; print('torch' in sys.modules)") == "False"  # set before torch, not after


def test_an_explicit_policy_wins():
    assert run("import os, engine; print(os.environ['OMP_WAIT_POLICY'])", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
