"""Work a test waits for, done from the start of the run by a child process beside the tests
that run before it.

Some tests spend minutes on one computation before they check anything: packages compiled ahead
of time (engine/aot.py; 30 s for a tiny random model, 2-4 minutes for SmolLM2) or SmolLM2's
precision reference. The tests before them (real processes talking over HTTP and Redis) leave a
core idle much of the time. A test marked `@pytest.mark.early.with_args(job)` names a function
of its module, `job(folder) -> a JSON value`, that does such work as the test would: at the start
of the run one child process (`python -m tests.helpers.early`), at a lower priority, runs the
jobs of the tests selected, in their order, each with a folder of its own (and, for packages,
that folder's cache as TORCHINDUCTOR_CACHE_DIR); the test waits for its job's value (`result`;
the `packages` fixture for packages) with the child at full priority meanwhile. A job that
raised fails its test with the traceback."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.processes import RUN_MARK, kill, session_members, spawn

ROOT = Path(__file__).resolve().parent.parent.parent
NICE = 10  # as the engine's own background build (engine/background.py)
WAIT_S = 1500


def job_name(job: Callable[[Path], Any]) -> str:
    """`module:function`, the module by its path under the repository (pytest may have imported
    it under another name)."""
    module = Path(sys.modules[job.__module__].__file__).resolve().relative_to(ROOT).with_suffix("")
    return f"{'.'.join(module.parts)}:{job.__qualname__}"


class EarlyJobs:
    """The child running the jobs, in a session of its own (`stop` ends all it started). It
    carries no RUN_MARK: it belongs to the run, not to a test, and a test that counts the run's
    processes (tests/processes.py `survivors`) must not find it."""

    def __init__(self, jobs: list[str], folder: Path) -> None:
        self.jobs, self.folder = jobs, folder
        folder.mkdir(parents=True, exist_ok=True)
        env = {key: value for key, value in os.environ.items() if key != RUN_MARK}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(folder / "early.log", "wb") as log:
            self.process = spawn([sys.executable, "-m", "tests.helpers.early", str(folder), *jobs],
                                 env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def wait(self, job: str, timeout_s: float = WAIT_S) -> Any:
        """The job's value once done; AssertionError with its traceback if it raised. The child
        runs at full priority meanwhile (where this process may raise it), as the test would."""
        done = self.folder / str(self.jobs.index(job)) / "result.json"
        self._renice(0)
        try:
            deadline = time.monotonic() + timeout_s
            while not done.exists():
                if self.process.poll() is not None:
                    raise AssertionError(f"the early jobs' child exited with {self.process.returncode} before {job}:\n"
                                         + (self.folder / "early.log").read_text(errors="replace")[-4000:])
                if time.monotonic() > deadline:
                    raise AssertionError(f"{job} not done within {timeout_s} s")
                time.sleep(0.2)
        finally:
            self._renice(NICE)
        result = json.loads(done.read_text())
        assert "error" not in result, f"{job} failed:\n{result.get('error')}"
        return result["value"]

    def _renice(self, nice: int) -> None:
        """Every thread of the child and of what it started (compilers, children of a job);
        lowering it needs the privilege to (root), else it stays where it is."""
        for pid in session_members(self.process.pid):
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(task), nice)
            except OSError:
                pass

    def stop(self) -> None:
        if self.process.poll() is None:
            kill(session_members(self.process.pid))
        self.process.wait()


def result(jobs: EarlyJobs | None, job: Callable[[Path], Any], folder: Path) -> Any:
    """`job`'s value: from the run's child, or (a test it was not started for) from a child of
    its own now, in `folder`."""
    name = job_name(job)
    if jobs is not None and name in jobs.jobs:
        return jobs.wait(name)
    alone = EarlyJobs([name], folder)
    try:
        return alone.wait(name)
    finally:
        alone.stop()


def packaged(engine) -> list[str]:
    """A job's value for packages: the paths of the engine's (`compile_decode` built them)."""
    return [str(p.path) for p in engine.compiled.packaged]


def copy_packages(packages: list[str], cache: Path) -> list[Path]:
    """The packages (and whatever else their build left in their folder) copied into `cache`'s
    package folder; the copies' paths."""
    into = cache / "strata-aot"
    into.mkdir(parents=True, exist_ok=True)
    for folder in {Path(p).parent for p in packages}:
        shutil.copytree(folder, into, dirs_exist_ok=True)
    return [into / Path(p).name for p in packages]


def _run(job: str, folder: Path) -> dict:
    from engine.compiled import release_compile_workers

    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "cache")
    module, _, name = job.partition(":")
    try:
        return {"value": getattr(importlib.import_module(module), name)(folder)}
    except Exception:  # noqa: BLE001 - reported by the test that waits for it
        return {"error": traceback.format_exc()}
    finally:
        release_compile_workers()


def main(folder: Path, jobs: list[str]) -> None:
    from engine.aot import die_with_parent

    die_with_parent()  # a test run killed outright leaves no child behind
    os.nice(NICE)
    for index, job in enumerate(jobs):
        done = _run(job, folder / str(index))
        scratch = folder / str(index) / "result.json.tmp"
        scratch.write_text(json.dumps(done))
        scratch.rename(scratch.with_suffix(""))  # whole, or not there


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
