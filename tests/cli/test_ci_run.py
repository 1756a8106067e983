""".ci/run, with stand-ins for the programs it calls (apt-get, make and the system programs it
checks for) on a PATH of their own: it installs what is missing, tells the tests they run in CI
(STRATA_CI=1, which turns a missing program's skip into a failure) and fails when `make test`
does, pytest's exit code 5 (no test collected) included."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = {"redis-server": "redis-server", "redis-cli": "redis-tools", "docker-compose": "docker-compose",
            "prometheus": "prometheus", "promtool": "prometheus"}
# What the script itself needs from the system.
UTILITIES = ("bash", "dirname", "sort")


def ci_run(tmp_path: Path, present: set[str], make_exit: int) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for utility in UTILITIES:
        (bin_dir / utility).symlink_to(shutil.which(utility))
    record = tmp_path / "record"

    def stand_in(name: str, body: str) -> None:
        (bin_dir / name).write_text(f"#!{shutil.which('bash')}\n{body}\n")
        (bin_dir / name).chmod(0o755)

    for program in present:
        stand_in(program, "exit 0")
    stand_in("apt-get", f'echo "apt-get $*" >> {record}')
    stand_in("make", f'echo "make $* STRATA_CI=$STRATA_CI" >> {record}; exit {make_exit}')
    done = subprocess.run([str(ROOT / ".ci" / "run")], env={"PATH": str(bin_dir)}, capture_output=True,
                          text=True, timeout=60)
    return done, record


@pytest.mark.parametrize("make_exit", [0, 1, 5])
def test_it_passes_exactly_when_make_test_does_and_says_it_is_ci(tmp_path, make_exit):
    done, record = ci_run(tmp_path, set(PROGRAMS), make_exit)
    assert done.returncode == make_exit, done.stderr
    assert record.read_text().splitlines() == ["make test STRATA_CI=1"]  # nothing to install


def test_it_installs_the_packages_of_the_missing_programs_first(tmp_path):
    done, record = ci_run(tmp_path, {"redis-server", "docker-compose"}, 0)
    assert done.returncode == 0, done.stderr
    update, install, make = record.read_text().splitlines()
    assert update == "apt-get update -qq"
    assert install.split()[-2:] == ["prometheus", "redis-tools"]  # each package once, for both of its programs
    assert make == "make test STRATA_CI=1"
