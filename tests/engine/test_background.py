"""The compiled decode step built in the background while the engine decodes eagerly
(engine/background.py, TorchEngine.compile_in_background): the switch between steps, a request
begun before it finishing on the eager step, the child's copy of the model's shapes, and one real
build by the low-priority child (the tiny model's packages)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import aot
from engine.background import BackgroundBuild, cpu_seconds, read_shapes, write_shapes
from engine.quants.build import compiler
from engine.runner import TorchEngine
from engine.step import StepInputs, step_body
from tests.helpers.tiny_engine import GREEDY, tiny_engine


class Shifted:
    """Stands in for a compiled package whose greedy tokens differ from eager's (the real ones
    part from eager at near-ties): eager's logits rolled by one token."""

    head, batched = True, False

    def __init__(self, engine: TorchEngine) -> None:
        self.model = engine.model
        self.calls = 0

    @property
    def ready(self) -> bool:
        return True

    def __call__(self, x: torch.Tensor, inputs: StepInputs) -> list[torch.Tensor]:
        self.calls += 1
        h, logits, candidates = step_body(self.model, x, inputs)
        return [h, logits.roll(1, dims=-1)] + ([] if candidates is None else [candidates.roll(1, dims=-1)])


class Build:
    """Stands in for BackgroundBuild: compiling until `done`, then its packages."""

    def __init__(self, steps: list[Shifted]) -> None:
        self.steps, self.state, self.started = steps, "compiling", 0.0

    def progress(self) -> int:
        return 40

    def take(self) -> list[Shifted] | None:
        return self.steps if self.state == "built" else None


def _compiled_from_start(engine: TorchEngine) -> TorchEngine:
    from engine.compiled import CompiledDecode

    engine.compiled = CompiledDecode(engine.model)
    engine.compiled.packaged = [Shifted(engine), Shifted(engine)]
    return engine


def _start(engine: TorchEngine, slot: int, prompt: list[int]) -> list[int]:
    engine.begin(slot, GREEDY)
    return [engine.read(slot, prompt, sample=True)]


def _steps(engine: TorchEngine, out: dict[int, list[int]], steps: int) -> None:
    for _ in range(steps):
        group = sorted(out)
        for slot, new in zip(group, engine.decode(group, [out[s][-1] for s in group])):
            out[slot] += new


A, B = [(3 * i + 1) % 256 for i in range(40)], [(7 * i + 2) % 256 for i in range(25)]


def test_a_request_begun_before_the_switch_ends_on_the_eager_step_and_later_ones_run_compiled():
    eager = tiny_engine()
    alone = {0: _start(eager, 0, A)}
    _steps(eager, alone, 40)
    compiled = _compiled_from_start(tiny_engine())
    other = {1: _start(compiled, 1, B)}
    _steps(compiled, other, 30)
    again = {0: _start(compiled, 0, A)}
    _steps(compiled, again, 10)
    assert again[0] != alone[0][:11]  # the stand-in's tokens are not eager's: a mix would show

    engine = tiny_engine()
    build = Build([Shifted(engine), Shifted(engine)])
    engine.building = build
    assert engine.decode_path().kind == "compiling" and engine.decode_path().percent == 40
    out = {0: _start(engine, 0, A)}
    _steps(engine, out, 10)
    build.state = "built"  # the packages are on disk: they take over between steps
    assert engine.decode_path().kind == "compiled" and engine.building is None
    out[1] = _start(engine, 1, B)
    calls = sum(step.calls for step in build.steps)
    _steps(engine, out, 30)  # slot 0 eager beside slot 1 compiled, in each step
    assert sum(step.calls for step in build.steps) == calls + 30
    assert out[0] == alone[0]  # begun before the switch: all eager, as if there had been none
    assert out[1] == other[1]  # begun after: all compiled
    del out[1]
    out[0] = _start(engine, 0, A)  # the slot's next request: compiled
    _steps(engine, out, 10)
    assert out[0] == again[0]


def test_the_child_gets_the_models_shapes_and_names_the_parents_packages(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    engine = tiny_engine()
    write_shapes(engine.model, tmp_path / "shapes.pickle")
    copy = read_shapes(tmp_path / "shapes.pickle")
    assert [aot.PackagedStep(copy, b).path for b in (False, True)] == [p.path for p in aot.packages(engine.model)]
    weights = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values()) + engine.model.kv_bytes()
    assert (tmp_path / "shapes.pickle").stat().st_size < weights / 20  # shapes, not the weights
    assert copy.embed is None  # the child never embeds
    assert (copy.head_rows is None) == (engine.model.head_rows is None)  # whether exact rows are recomputed
    for (_, name), real, made in zip(aot.packages(engine.model)[0].places, aot.packages(engine.model)[0].tensors,
                                     aot.PackagedStep(copy, False).tensors, strict=True):
        assert (made.shape, made.stride(), made.dtype) == (real.shape, real.stride(), real.dtype), name


_EXPORT_FROM_SHAPES = """
import os, sys
from engine import aot
from engine.background import read_shapes
copy = read_shapes(sys.argv[1])
print(aot.PackagedStep(copy, batched=True).path)
os.unlink(aot.PackagedStep(copy, batched=True).export())
"""


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler: engine/quants' kernels cannot be built")
def test_a_k_quant_models_shapes_name_its_packages_and_trace_in_a_fresh_process(tmp_path, monkeypatch):
    """A K-quant file's model (blocks through engine/quants' op, a Q6_K head): the child's copy
    names the parent's packages, and a process that has not loaded the op yet (the child is
    one) exports the step."""
    from engine.gguf_loader import GGUFModel
    from engine.model import Transformer
    from tests.helpers.quant_models import write_mix

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    write_mix(tmp_path / "tiny.gguf", "Q4_K_M")
    loaded = GGUFModel(tmp_path / "tiny.gguf")
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=torch.device("cpu"), int4=True)
    model.allocate_cache(num_slots=2, ctx=100)
    assert model.forms.get("quant") == sum(model.forms.values())
    write_shapes(model, tmp_path / "shapes.pickle")
    copy = read_shapes(tmp_path / "shapes.pickle")
    paths = [aot.PackagedStep(model, b).path for b in (False, True)]
    assert [aot.PackagedStep(copy, b).path for b in (False, True)] == paths
    done = subprocess.run([sys.executable, "-c", _EXPORT_FROM_SHAPES, str(tmp_path / "shapes.pickle")],
                          env=aot.child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(paths[1])]


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_a_build_in_the_background_takes_over_with_the_packages_and_a_copied_cache_is_reused(tmp_path, monkeypatch):
    """The real child: it runs at a lower priority, the engine serves eagerly meanwhile, the
    packages it built take over (their tokens are those of the same packages built in the
    foreground), a second engine starting at once on the same cache folder waits for that build
    rather than building the packages again, and a copy of the cache folder in a fresh place (the original gone) loads them."""
    built = tmp_path / "built"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(built))
    engine, twin, loaded = tiny_engine(), tiny_engine(), tiny_engine()
    try:
        _build_takes_over_then_a_copy_loads(engine, twin, loaded, built, tmp_path / "fresh", monkeypatch)
    finally:  # a failed check leaves no compiler running
        for each in (engine, twin, loaded):
            each.stop_building()


def _build_takes_over_then_a_copy_loads(engine: TorchEngine, twin: TorchEngine, loaded: TorchEngine, built: Path,
                                        fresh: Path, monkeypatch) -> None:
    engine.compile_in_background()
    twin.compile_in_background()  # a second worker on the same data folder, at the same time
    build, other = engine.building, twin.building
    assert isinstance(build, BackgroundBuild) and engine.decode_path().kind == "compiling"
    assert build.wait(timeout=300, until="started") == "compiling"
    assert _nice(build._child.pid) == _nice(os.getpid()) + 10  # the child lowered its own priority
    out = {0: _start(engine, 0, A)}
    _steps(engine, out, 5)
    assert build.wait(timeout=900) == "built", build.error
    assert other.wait(timeout=900) == "built", other.error
    # one built the packages, the other waited for that build and found them: built once
    waited = [b for b in (build, other) if b.waiting_for]
    assert len(waited) == 1 and waited[0].waiting_for in (build._child.pid, other._child.pid)
    assert waited[0]._done == {"started", "found one-row step", "found batched step"}
    assert all(b.progress() == 100 for b in (build, other))
    assert engine.decode_path().kind == "compiled" and twin.decode_path().kind == "compiled"
    assert engine.compiled is not None and all(p.ready for p in engine.compiled.packaged)
    recorded = json.loads((built / "strata-aot" / "build-seconds.json").read_text())  # the next estimate's
    assert recorded["steps"] == 2 and recorded["cpu_seconds"] > 0
    del out[0]
    out[1] = _start(engine, 1, B)
    _steps(engine, out, 20)

    shutil.copytree(built, fresh)
    shutil.rmtree(built)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(fresh))
    loaded.compile_in_background()
    assert loaded.building is None and loaded.decode_path().kind == "compiled"  # nothing to build
    reference = {1: _start(loaded, 1, B)}
    _steps(loaded, reference, 20)
    assert out[1] == reference[1]


@pytest.mark.smollm2
def test_the_default_engines_shapes_name_its_packages(smollm2_default, tmp_path, monkeypatch):
    """The default engine (int4 linears with their oneDNN prefill copies, the head from the file's
    Q8_0 blocks, its rows): the child's copy names the same packages, without the weights."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = smollm2_default.model
    write_shapes(model, tmp_path / "shapes.pickle")
    copy = read_shapes(tmp_path / "shapes.pickle")
    assert [aot.PackagedStep(copy, b).path for b in (False, True)] == [aot.PackagedStep(model, b).path for b in (False, True)]
    assert (tmp_path / "shapes.pickle").stat().st_size < 1 << 20
    assert copy.head_rows is not None  # the head's rows (the tied embedding's) come through the copy
    os.unlink(aot.PackagedStep(copy, batched=False).export())  # the child's copy traces (compiling it: the bench)


def test_the_cpu_seconds_of_a_process_count_the_children_it_waited_for():
    """A build's progress counts its compilers' CPU time too: those it ran and waited for."""
    burn = "import time\nx = 0\nfor i in range(4 * 10**6): x += i\nprint(time.process_time())"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               f"subprocess.run([sys.executable, '-c', {burn!r}]); sys.stdin.readline()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child_s = float(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while (counted := cpu_seconds(parent.pid)) is not None and counted < child_s and time.monotonic() < deadline:
            time.sleep(0.05)  # the child has printed, and is being waited for
        assert counted is not None and counted >= child_s - 0.02  # clock ticks of 10 ms
    finally:
        parent.communicate("\n", timeout=30)
    assert cpu_seconds(parent.pid) is None  # gone


def test_the_percent_follows_the_builds_cpu_seconds_between_its_milestones(caplog):
    engine = tiny_engine()
    build = BackgroundBuild(engine.model, aot.packages(engine.model))
    build._cpu_at = float("inf")  # the CPU seconds set below, not read from /proc
    build._cpu = 0.3 * build._expected_cpu_s
    assert build.percent() == 2  # before the child says it is up: under its first milestone
    build._done |= {"started", "exported one-row step", "exported batched step"}
    assert build.percent() == 30
    build._cpu = 0.9 * build._expected_cpu_s
    assert build.percent() == 55  # not "compiled" yet: under that milestone
    build._done.add("compiled one-row step")
    assert build.percent() == 90
    caplog.set_level("INFO", logger="engine.background")
    for _ in range(3):
        build.progress()
    build._done.add("compiled batched step")
    build.progress("compiled batched step")  # the follower, at the milestone
    build._cpu = 1.5 * build._expected_cpu_s  # more than estimated: still under 100 until it is built
    assert build.progress() == 99
    assert [r.getMessage() for r in caplog.records] == [  # each once
        "compiling the decode step, serving eager meanwhile: 90 %",
        "compiling the decode step, serving eager meanwhile: 90 % (compiled batched step)"]


def test_the_package_key_holds_the_instruction_sets_not_the_rest_of_the_flags():
    """A cache copied to another host of the same kind is reused: its flags line differs in TSX,
    mitigation and hypervisor flags and its model name, not in the instructions code may use."""
    here = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse sse2 avx avx2 hle rtm avx512f amx_bf16 hypervisor\n"
    there = "model name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: fpu sse sse2 avx avx2 avx512f amx_bf16 arch_capabilities\n"
    no_amx = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse sse2 avx avx2 hle rtm avx512f hypervisor\n"
    assert aot.isa(here) == aot.isa(there) == "amx_bf16 avx avx2 avx512f sse sse2"
    assert aot.isa(no_amx) != aot.isa(here)
