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
import resource
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
# The build's progress is counted in CPU seconds (the builder's and its compilers'), not wall
# seconds: the build runs at nice 10, so under load its wall time stretches many times over
# (147 s quiet, 700 s beside other work) while the CPU time it needs stays put. A finished build
# writes its CPU seconds beside the packages; before any, this estimate per decode layer and
# step: SmolLM2-135M (30 layers, the one-row and the batched step) took 269.9 CPU s on this
# project's Xeon (bench.first_token, 2026-12-02, while its wall time was 931 s under load 13-16).
DEFAULT_CPU_S_PER_LAYER_STEP = 4.5
# Percent of the build at its milestones, in the order they come: the child is up, each step
# exported, each compiled (most of the time, side by side). The CPU estimate moves between them.
MILESTONES = (3, 8, 13, 56, 100)
LOG_EVERY = 10  # percent between progress lines (and one at each milestone)


def cpu_seconds(root: int) -> float | None:
    """CPU seconds used by process `root` and every process under it, the ended ones included
    (their time is in their parents' cutime/cstime once waited for); None where /proc is not."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, own + waited-for children's seconds)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        stats[int(entry)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / tick)
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


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
    """What the last build here took: wall and CPU seconds, and how many steps it built."""
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
        self.waiting_for = 0  # the pid of another worker's build this one waits for (one cache folder)
        self._done: set[str] = set()
        self._changed = threading.Condition()
        self._child: subprocess.Popen | None = None
        self._counted = 0  # whose CPU time is the build's: the child, or the build it waits for
        self._cpu, self._cpu_at = 0.0, -1.0
        self._logged = 0  # start() says the build began: no "0 %" line
        todo = sum(not step.ready for step in steps)
        self._expected_cpu_s = DEFAULT_CPU_S_PER_LAYER_STEP * len(model.layers) * max(todo, 1)
        try:
            recorded = json.loads(_timing_file().read_text())
            self._expected_cpu_s = float(recorded["cpu_seconds"]) * max(todo, 1) / int(recorded["steps"])
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
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
        self._counted = self._child.pid
        threading.Thread(target=self._follow, args=(self._child, shapes), name="compile-follower", daemon=True).start()
        log.info("compiling the decode step in a low-priority process (pid %d, nice %d), serving eager meanwhile",
                 self._child.pid, NICE)
        return self

    def _follow(self, child: subprocess.Popen, shapes: str) -> None:
        """Read the child's output to its end (the follower thread)."""
        tail: list[str] = []
        assert child.stdout is not None
        for line in child.stdout:
            if not line.startswith(EVENT):
                tail = (tail + [line.rstrip()])[-40:]
                continue
            event = line[len(EVENT):].strip()
            kind, _, rest = event.partition(" ")
            if kind == "cpu":  # the child built the packages in that many CPU seconds
                self._record(float(rest))
                continue
            with self._changed:
                if kind == "waiting":
                    self.waiting_for = int(rest) if rest.isdigit() else 0
                    self._counted = self.waiting_for or self._counted
                    log.info("another worker's build (pid %s) makes the same packages in this cache folder: "
                             "waiting for it rather than building them twice", rest)
                else:
                    self._done.add(event)
                self._changed.notify_all()
            self.progress(event)
        child.wait()
        os.unlink(shapes)
        if child.returncode == 0:
            self.state = "built"
        else:
            self.error = f"exit code {child.returncode}: " + "\n".join(tail[-20:])
            self.state = "failed"
            log.warning("compiling the decode step failed; decoding eagerly from now on (%s)", self.error)
        with self._changed:
            self._changed.notify_all()

    def _record(self, cpu_s: float) -> None:
        """What this build took, for the next one's estimate in this cache folder."""
        built = sum(not step.ready for step in self.steps)
        try:
            _timing_file().write_text(json.dumps({"seconds": round(time.monotonic() - self.started, 1),
                                                  "cpu_seconds": round(cpu_s, 1), "steps": built}))
        except OSError:
            pass

    def wait(self, timeout: float, until: str | None = None) -> str:
        """Block until the build ends (or, `until`, the child reports that event) or `timeout`
        seconds pass; returns the state then. For tests and benches: the worker never waits."""
        with self._changed:
            self._changed.wait_for(lambda: self.state != "compiling" or (until is not None and until in self._done),
                                   timeout)
            return self.state

    def percent(self) -> int:
        """How far the build is: its last milestone, or further by the CPU seconds its builder has
        used of those a build needs here (the last build's, else an estimate per layer), never up
        to the next milestone. A build waited for reports no milestones here: only its CPU counts."""
        if self.state == "built":
            return 100
        count = min(len(self._done), len(MILESTONES) - 1)
        reached = MILESTONES[count - 1] if count else 0
        ceiling = 99 if self.waiting_for else MILESTONES[count] - 1
        now = time.monotonic()
        if now - self._cpu_at >= 1.0 and self._counted:  # a walk of /proc: at most once a second
            self._cpu = cpu_seconds(self._counted) or self._cpu
            self._cpu_at = now
        estimate = 100.0 * self._cpu / self._expected_cpu_s
        return int(min(max(estimate, reached), ceiling))

    def progress(self, milestone: str = "") -> int:
        """The percent, and a log line at each milestone and every LOG_EVERY percent (one place
        says it: the follower at milestones, the serving thread between them)."""
        percent = self.percent()
        with self._changed:
            due = milestone or percent // LOG_EVERY > self._logged // LOG_EVERY
            if due and self.state == "compiling":
                self._logged = percent
                log.info("compiling the decode step, serving eager meanwhile: %d %%%s", percent,
                         f" ({milestone})" if milestone else "")
        return percent

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
    events: list[str] = []

    def report(event: str) -> None:
        events.append(event)
        print(EVENT + event, flush=True)

    aot.build(steps, load=False, report=report)
    if any(e.startswith("compiled ") for e in events) and not any(e.startswith("found ") for e in events):
        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        print(EVENT + f"cpu {sum(u.ru_utime + u.ru_stime for u in used):.1f}", flush=True)  # for the next estimate
    return 0 if all(step.error is None for step in steps) else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    sys.exit(main(sys.argv[1], sys.argv[2:]))
