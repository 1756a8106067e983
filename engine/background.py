"""The compiled decode step built while the worker serves (the CPU's packages, engine/aot.py).

On a fresh data folder the packages take a minute or more to build. Rather than make every
request wait for them, the engine decodes eagerly at once while a low-priority child process
builds them, and takes them at a step boundary once they are on disk (`TorchEngine.begin` and
`decode_path`, engine/runner.py); requests begun before that finish on the eager step, so a
request's tokens never depend on when the switch came.

A process, not a thread: exporting a step flips process-wide settings while it traces (torch's
export turns oneDNN off, `torch.backends.mkldnn.set_flags(False)`, which the serving thread's
eager kernels would see), holds the GIL for seconds, and only a process can be given a lower
priority (`NICE`) and one thread, so that the serving process keeps the cores whenever it has
work. The child gets the model's shapes, not its weights: the model is pickled with every
tensor replaced by its shape, stride and dtype (`write_shapes`), and the child makes
uninitialized tensors of those (pages never touched cost no memory; tracing reads only
metadata), so a big model is not held twice. It exports both steps and compiles them side by
side (`aot.build`), telling the parent on stdout how far it is; the packages' names (their cache
keys) come out the same as the parent's, since they are computed from the same shapes.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine import aot
from engine.model import Transformer

log = logging.getLogger(__name__)

NICE = 10  # under contention ~1/10 of a core's share against the serving process (nice 0)
EVENT = "strata-build: "  # how the child's progress lines start on its stdout
# How long a build takes when none was timed in this cache folder yet: SmolLM2 on 2 quiet
# cores (~70 s, docs/engine.md); a finished build writes its own time beside the packages.
DEFAULT_BUILD_S = 90.0
# Percent of the build at its milestones, in the order they come: the child is up, each step
# exported (seconds), each compiled (most of the time, side by side).
MILESTONES = (3, 8, 13, 56, 100)


class _NoRows(nn.Module):
    """What the child has for the head's exact rows (a submodule where the model has them): only
    whether there are any matters there."""


class _ShapesPickler(pickle.Pickler):
    def __init__(self, file: Any, model: Transformer) -> None:
        super().__init__(file)
        self.model = model

    def persistent_id(self, obj: object) -> tuple[Any, ...] | None:
        # the head's exact rows first: with tied embeddings they are the embedding itself, and
        # whether there are any decides what the packaged head returns (its candidates)
        if obj is self.model.head_rows and obj is not None:
            return ("rows",)
        if obj is self.model.embed and obj is not None:
            return ("none",)  # looked up before the step: the child never embeds
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:  # oneDNN's prefill copies: never in a package
                return ("empty",)
            return ("tensor", tuple(obj.shape), tuple(obj.stride()), str(obj.dtype).removeprefix("torch."))
        return None


class _ShapesUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: tuple[Any, ...]) -> object:
        kind = pid[0]
        if kind == "none":
            return None
        if kind == "rows":
            return _NoRows()
        if kind == "empty":
            return torch.empty(0)
        _, shape, stride, dtype = pid
        return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype))


def write_shapes(model: Transformer, path: Path) -> None:
    with open(path, "wb") as file:
        _ShapesPickler(file, model).dump(model)


def read_shapes(path: Path) -> Transformer:
    with open(path, "rb") as file:
        return _ShapesUnpickler(file).load()


def _timing_file() -> Path:
    return aot.package_folder() / "build-seconds.json"


class BackgroundBuild:
    """The packages of `steps` (those not loaded yet) built by a child process; `take` loads
    them once it is done. Its state and progress are read by the serving thread; only the
    thread reading the child's output writes them."""

    def __init__(self, model: Transformer, steps: list[aot.PackagedStep]) -> None:
        self.model, self.steps = model, steps
        self.started = time.monotonic()
        self.state = "compiling"  # -> "built" (child done, packages on disk) | "failed"
        self.error = ""
        self._done: set[str] = set()
        self._changed = threading.Condition()
        self._child: subprocess.Popen | None = None
        self._expected_s = DEFAULT_BUILD_S
        try:
            self._expected_s = float(json.loads(_timing_file().read_text())["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def start(self) -> "BackgroundBuild":
        folder = aot.package_folder()
        folder.mkdir(parents=True, exist_ok=True)
        fd, shapes = tempfile.mkstemp(suffix=".pickle", prefix="shapes-", dir=folder)
        os.close(fd)
        write_shapes(self.model, Path(shapes))
        env = aot.child_env(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
        wanted = [str(step.path) for step in self.steps if not step.ready]
        self._child = subprocess.Popen(
            [sys.executable, "-m", "engine.background", shapes, *wanted], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._follow, args=(self._child, shapes), name="compile-follower", daemon=True).start()
        log.info("compiling the decode step in a low-priority process (pid %d, nice %d), serving eager meanwhile",
                 self._child.pid, NICE)
        return self

    def _follow(self, child: subprocess.Popen, shapes: str) -> None:
        """Read the child's output to its end (the follower thread)."""
        tail: list[str] = []
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(EVENT):
                with self._changed:
                    self._done.add(line[len(EVENT):].strip())
                    self._changed.notify_all()
                log.info("compiling the decode step, serving eager meanwhile: %d %% (%s)", self.percent(),
                         line[len(EVENT):].strip())
            else:
                tail = (tail + [line.rstrip()])[-40:]
        child.wait()
        os.unlink(shapes)
        if child.returncode == 0:
            took = time.monotonic() - self.started
            try:
                _timing_file().write_text(json.dumps({"seconds": round(took, 1)}))
            except OSError:
                pass
            self.state = "built"
        else:
            self.error = f"exit code {child.returncode}: " + "\n".join(tail[-20:])
            self.state = "failed"
            log.warning("compiling the decode step failed; decoding eagerly from now on (%s)", self.error)
        with self._changed:
            self._changed.notify_all()

    def wait(self, timeout: float, until: str | None = None) -> str:
        """Block until the build ends (or, `until`, the child reports that event) or `timeout`
        seconds pass; returns the state then. For tests and benches: the worker never waits."""
        with self._changed:
            self._changed.wait_for(lambda: self.state != "compiling" or (until is not None and until in self._done),
                                   timeout)
            return self.state

    def percent(self) -> int:
        """How far the build is: its last milestone, or further by the time a build took here
        before, never up to the next milestone."""
        if self.state == "built":
            return 100
        count = min(len(self._done), len(MILESTONES) - 1)
        reached, next_one = (MILESTONES[count - 1] if count else 0), MILESTONES[count]
        estimate = 100.0 * (time.monotonic() - self.started) / self._expected_s
        return int(min(max(estimate, reached), next_one - 1))

    def take(self) -> list[aot.PackagedStep] | None:
        """The steps, all loaded, once the child has built them (else None: still building or
        failed). In the serving thread, between steps."""
        if self.state != "built":
            return None
        for step in self.steps:
            if not step.ready:
                step.load_cached()
        if not all(step.ready for step in self.steps):
            self.state, self.error = "failed", "the packages built could not be loaded"
            log.warning("decoding eagerly from now on: %s", self.error)
            return None
        return self.steps

    def stop(self) -> None:
        """End the child and its compilers (the worker is leaving)."""
        if self._child is not None and self._child.poll() is None:
            try:
                os.killpg(self._child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def main(shapes: str, wanted: list[str]) -> int:
    os.nice(NICE)
    aot.die_with_parent()
    print(EVENT + "started", flush=True)
    model = read_shapes(Path(shapes))
    steps = [aot.PackagedStep(model, batched=False)] + ([aot.PackagedStep(model, batched=True)]
                                                       if model.num_slots > 1 else [])
    steps = [step for step in steps if str(step.path) in wanted]
    if len(steps) != len(wanted):  # the shapes gave other keys than the parent's: nothing to build
        print(f"packages {[str(s.path) for s in steps]} are not the ones asked for: {wanted}", flush=True)
        return 1
    aot.build(steps, load=False, report=lambda event: print(EVENT + event, flush=True))
    return 0 if all(step.error is None for step in steps) else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    sys.exit(main(sys.argv[1], sys.argv[2:]))
