"""The decode step compiled ahead of time: every layer, the final norm and the head in one C++ call.

At one row, calling each layer's compiled graph from Python costs about as much as the layer's
arithmetic: dynamo's guards, the wrapper's allocations and calls, ~80 of ~230 us a layer on this
machine. AOTInductor compiles the stack of layers — the graph inductor builds for one layer,
repeated — into a shared library with a C++ wrapper that a step calls once (SmolLM2's 30
layers: 3.9 ms against 7.1 ms). Two packages: one row, and 2 to num_slots rows (batch size and
attention span dynamic). A row's results do not depend on its neighbours (one-row package =
batched package, bit for bit), but they are not always the per-layer graphs' bit for bit (a
residual added in another kernel rounds the same float32 sums in another order; a bf16 step apart
in a few logits), so a worker never mixes the two: it builds the packages before it serves, and
uses them for every step or (a build failed) for none.

The head is inside (`Transformer.head_step`: its logits and which of them to recompute exactly)
unless it is oneDNN-prepacked (not a tensor a graph can take), and then `compiled._head` follows.
With the head inside, a restart with cached packages never starts dynamo or inductor: it loads two
shared libraries (~3 s less than tracing the head's graphs; the start-up in docs/engine.md).

The weights and K/V buffers are the package's inputs, not constants: a package holds only code
(a few MB), runs on the model's own tensors and writes the K/V buffers in place. Packages are kept
under inductor's cache folder (`--data-dir`/cache/inductor/strata-aot) by a key of everything the
code depends on: torch, this engine's source, the weights' shapes and strides, the CPU; a restart
loads them in well under a second. The K/V pools' size is dynamic, so
a new --parallel or --ctx runs the packages built before. Export takes seconds; the compile (~1
min a package for SmolLM2, both side by side) runs in child processes (`python -m engine.aot`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import Tensor, nn

from engine.model import CacheIndex, Transformer
from engine.quants.blocks import QuantLinear
from engine.quants.build import load as load_ops
from engine.step import StepInputs, step_body
from engine.weights import PackedLinear

log = logging.getLogger(__name__)

# what the packaged step runs (the quants' op schema and its fake kernel among it)
_SOURCES = ("model.py", "layers.py", "step.py", "moe.py", "weights.py", "aot.py", "quants/blocks.py",
            "quants/fake.py", "quants/ops.cpp", "attend.cpp")


def head_inside(model: Transformer) -> bool:
    """Whether the packages hold the head too: not when it is oneDNN-prepacked (a bf16 head where
    the int8 kernel is missing), which a graph cannot take as an input. A K-quant head (the
    file's blocks, `QuantLinear`) is inside: its blocks are inputs like any weight."""
    return not isinstance(model.head, PackedLinear)


def _tensors(owners: list[object]) -> list[tuple[object, str]]:
    """Every tensor attribute of these objects (a module's submodules included), as (owner,
    attribute). A bf16 prepacked copy (oneDNN's layout, not a graph input) serves only prefill
    chunks: left out."""
    found = []
    for owner in owners:
        for part in owner.modules() if isinstance(owner, nn.Module) else [owner]:
            if isinstance(part, PackedLinear):
                continue
            for name, value in vars(part).items():
                if isinstance(value, Tensor) and value.layout == torch.strided and value.numel() > 0:
                    found.append((part, name))
    return found


class _Step(nn.Module):
    """The step as a function of the model's tensors, for export: each call puts the given
    tensors where the model looks for them, so the traced graph takes them as inputs."""

    def __init__(self, model: Transformer, places: list[tuple[object, str]], head: bool, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.places, self.head, self.names = model, places, head, names

    def forward(self, x: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        """x: [B, 1, dim]; tensors: the step's inputs (`StepInputs.tensors`), then the model's."""
        n = len(tensors) - len(self.places)
        kept = [getattr(owner, name) for owner, name in self.places]
        for (owner, name), tensor in zip(self.places, tensors[n:]):
            setattr(owner, name, tensor)
        try:
            out = step_body(self.model, x, StepInputs.of(tensors[:n], self.names), head=self.head)
            return tuple(t for t in out if t is not None)  # a graph returns tensors only
        finally:
            for (owner, name), tensor in zip(self.places, kept):
                setattr(owner, name, tensor)


def example_inputs(model: Transformer, rows: int, span: int) -> tuple[Tensor, StepInputs]:
    """The step's own inputs for `rows` rows: x [B, 1, dim] float32 and the `StepInputs`."""
    slots = torch.arange(rows, device=model.device).unsqueeze(1)
    positions = torch.zeros(rows, 1, dtype=torch.long, device=model.device)
    x = torch.zeros(rows, 1, model.cfg.dim, device=model.device)
    inputs = model.step_inputs(CacheIndex(0, model.num_slots, span, slots, positions, sliced=False))
    return x, inputs


# The flags naming instruction sets that compiled code may use. The rest of the flags line
# (hle/rtm, arch_capabilities, tsc_known_freq, the hypervisor's) and the model name differ between
# hosts of one kind with the same instructions, and a cache keyed by them was built again when
# copied to another machine.
_ISA_FLAGS = ("sse", "ssse3", "avx", "amx", "fma", "f16c", "bmi", "popcnt", "lzcnt", "abm", "movbe", "adx",
              "aes", "vaes", "pclmulqdq", "vpclmulqdq", "gfni", "sha_ni")


def isa(cpuinfo: str) -> str:
    """The instruction sets in /proc/cpuinfo's text (its first processor), sorted."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = line.partition(":")[2].split()
            return " ".join(sorted(f for f in flags if f.startswith(_ISA_FLAGS)))
    return ""


def _cpu() -> str:
    """What the generated code may rely on: the CPU's instruction sets. (inductor's own
    pick_vec_isa builds and loads a probe per instruction set in child processes: ~1 s at every
    start.)"""
    try:
        return isa(Path("/proc/cpuinfo").read_text()) or platform.machine()
    except OSError:
        return platform.processor() or platform.machine()


MAX_SLOTS, MAX_LENGTH, MAX_POOL = 4096, 1 << 20, 1 << 26  # what the packages are built to take


def _state_dims(owner: object, name: str) -> dict[int, str] | None:
    """A layer's state buffer (its mixer's STATE, engine/layers.py): its dims that follow the
    slot count or the KV pool's size, by name ("slots", "tokens"); None for any other tensor."""
    return getattr(type(owner), "STATE", {}).get(name)


def package_key(model: Transformer, batched: bool, places: list[tuple[object, str]], head: bool) -> str:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    # not the slot count nor the context: the K/V buffers' sizes are dynamic (one slot, a size
    # export fixes, is built apart)
    parts = ["batched" if batched else "one row", "head" if head else "layers", torch.__version__,
             repr(model.cfg), str(model.dtype), _cpu(), str(torch.backends.cpu.get_cpu_capability()),
             "one slot" if model.num_slots == 1 else "slots",
             # attention read in place (engine/attend.cpp) or gathered: another graph
             "in place" if model.reads_in_place else "gathered"]
    # the layout of blocks (which parts are of which type): the shapes alone do not tell it
    parts += [f"{name}: {m.extra_repr()}" for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    for owner, name in places:
        t, dims = getattr(owner, name), _state_dims(owner, name)
        if dims is None:
            parts.append(f"{tuple(t.shape)}{t.stride()}{t.dtype}")
        else:
            parts.append(f"{name}{tuple('*' if d in dims else n for d, n in enumerate(t.shape))}{t.dtype}")
    digest.update("\n".join(parts).encode())
    return digest.hexdigest()[:32]


def package_folder() -> Path:
    """Inductor's cache folder, read as inductor reads it."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # set by compiled.use_cache_dir (--data-dir)
    if base is None:  # only here: importing inductor to ask costs a second
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        base = default_cache_dir()
    return Path(os.path.abspath(base)) / "strata-aot"


class PackagedStep:
    """A decode step from an AOTInductor package: one row, or (`batched`) 2 to num_slots rows;
    `ready` once loaded. `head`: the package ends with the head (`head_inside`)."""

    def __init__(self, model: Transformer, batched: bool) -> None:
        self.model, self.batched, self.head = model, batched, head_inside(model)
        self.name = "batched step" if batched else "one-row step"
        owners: list[object] = list(model.layers)
        if self.head:
            owners += [model.head] + ([model.head_bound] if model.head_bound else [])
        self.places = _tensors(owners) + ([(model, "norm")] if self.head else [])
        self.tensors = [getattr(owner, name) for owner, name in self.places]
        self._run: Callable[[list[Tensor]], list[Tensor]] | None = None
        self.error: BaseException | None = None
        self.path = package_folder() / f"{package_key(model, batched, self.places, self.head)}.pt2"

    @property
    def ready(self) -> bool:
        return self._run is not None

    def __call__(self, x: Tensor, inputs: StepInputs) -> list[Tensor]:
        """x: [B, 1, dim] float32 embeddings -> with the head: the final-normed rows h [B, dim],
        the head's logits and (a low-precision head) the candidates for `Transformer.exact_top`;
        without: the last layer's output [B, 1, dim]."""
        assert self._run is not None
        return self._run([x, *inputs.tensors(), *self.tensors])

    def load_cached(self) -> None:
        if self.path.exists():
            try:
                self._load()
            except Exception:  # not a package this torch can load: build it again
                log.warning("could not load %s; building it again", self.path, exc_info=True)

    def export(self) -> str:
        """Trace the layers (the model's tensors are swapped for the trace's inputs meanwhile, so
        nothing may run the model concurrently) and save the program for `build`."""
        started = time.perf_counter()
        load_ops()  # engine/quants' ops and their fake kernels (a child building from shapes had not loaded them)
        load_ops("strata_attend")  # and engine/attend.cpp's
        rows = 2 if self.batched else 1
        x, inputs = example_inputs(self.model, rows, min(self.model.ctx, 256))
        # the step's rows and span dynamic (StepInputs.dims), and the layers' KV pool's size: any
        # batch, --parallel, --ctx and --kv-tokens run the same code
        named = {"batch": torch.export.Dim("batch", min=2, max=MAX_SLOTS),
                 "span": torch.export.Dim("span", min=2, max=MAX_LENGTH),
                 "tokens": torch.export.Dim("tokens", min=2, max=MAX_POOL)}
        if self.model.num_slots > 1:
            named["slots"] = torch.export.Dim("slots", min=2, max=MAX_SLOTS)

        def dynamic(spec: dict[int, str] | None) -> dict[int, Any] | None:
            return {dim: named[name] for dim, name in (spec or {}).items() if name in named} or None

        rows_dims = dynamic({0: "batch"} if self.batched else {})
        with torch.inference_mode():
            exported = torch.export.export(
                _Step(self.model, self.places, self.head, inputs.names()), (x, *inputs.tensors(), *self.tensors),
                dynamic_shapes=(rows_dims, (*map(dynamic, inputs.dims(self.batched)),
                                            *(dynamic(_state_dims(o, n)) for o, n in self.places))))
        shapes = [(tuple(t.shape), t.stride(), str(t.dtype).removeprefix("torch.")) for t in exported.example_inputs[0]]
        exported.example_inputs = None  # the weights and K/V buffers themselves: ~1 GB to write for nothing
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, program = tempfile.mkstemp(suffix=".pt2", prefix="exported-", dir=self.path.parent)
        os.close(fd)
        torch.export.save(exported, program, extra_files={"inputs.json": json.dumps(shapes)})
        log.info("exported the %s in %.1fs", self.name, time.perf_counter() - started)
        return program

    def start_build(self, program: str) -> subprocess.Popen:
        """Compile the exported program in a child process (`finish_build` waits for it)."""
        return subprocess.Popen([sys.executable, "-m", "engine.aot", program, str(self.path)], env=child_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def finish_build(self, program: str, child: subprocess.Popen, started: float, load: bool = True) -> None:
        """Wait for the child and (`load`) load its package; on failure `error` says why."""
        try:
            try:
                _, errors = child.communicate()
            finally:
                os.unlink(program)
            if child.returncode != 0:
                raise RuntimeError(f"python -m engine.aot exited with {child.returncode}: {errors[-2000:]}")
            log.info("%s compiled ahead of time in %.1fs", self.name, time.perf_counter() - started)
            if load:
                self._load()
        except Exception as error:
            self.error = error
            log.warning("compiling the %s ahead of time failed", self.name, exc_info=True)

    def _load(self) -> None:
        # the loader aoti_load_package wraps, without its check of the CPU's vector instructions
        # against the package's (the key already holds the CPU's flags; the check probes ~1 s)
        loader = torch._C._aoti.AOTIModelPackageLoader(str(self.path), "model", False, 1, -1)
        self._run = loader.boxed_run
        log.info("%s compiled ahead of time: loaded %s", self.name, self.path.name)


def packages(model: Transformer) -> list[PackagedStep]:
    """The one-row and (more than one slot) the batched step's packages, loaded where cached."""
    steps = [PackagedStep(model, batched=False)]
    if model.num_slots > 1:
        steps.append(PackagedStep(model, batched=True))
    for step in steps:
        step.load_cached()
    return steps


@contextlib.contextmanager
def build_lock(folder: Path, report: Callable[[str], None] = lambda _: None) -> Iterator[None]:
    """One build at a time in a cache folder: two workers on one data folder (`--devices cpu,cpu`)
    would build the same packages twice, each at half speed. The lock (`strata-aot.lock` beside
    the folder, which holds packages only) is the kernel's (flock), so a builder killed outright
    lets the next one in; the holder's pid is in the file, and `report` hears "waiting <pid>"
    while another holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip()
            report(f"waiting {holder if holder.isdigit() else 0}")
            log.info("waiting for the build of process %s in %s", holder or "?", folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))  # whose CPU time (its and its compilers') a waiter's progress counts
        lock.flush()
        try:
            yield
        finally:
            lock.truncate(0)


def build(steps: list[PackagedStep], load: bool = True, report: Callable[[str], None] = lambda _: None) -> None:
    """Export the steps not loaded yet, compile them side by side (one child process each: the
    compiler is mostly one thread) and (`load`) load them, one build at a time in the cache folder
    (`build_lock`): a package another process built meanwhile is taken as it is. `report` hears
    "exported <name>" and "compiled <name>" as each part ends (engine/background.py's progress)."""
    with build_lock(package_folder(), report):
        _build(steps, load, report)


def _build(steps: list[PackagedStep], load: bool, report: Callable[[str], None]) -> None:
    started, children = time.perf_counter(), []
    for step in steps:
        if not step.ready and step.path.exists():  # built by another process while this one waited
            if load:
                step.load_cached()
            if step.ready or not load:
                report(f"found {step.name}")
                continue
        if step.ready:
            continue
        try:
            program = step.export()
        except Exception as error:  # this torch cannot trace it: no packages (the caller checks)
            step.error = error
            log.warning("exporting the %s failed", step.name, exc_info=True)
            continue
        report(f"exported {step.name}")
        children.append((step, program, step.start_build(program)))
    for step, program, child in children:
        step.finish_build(program, child, started, load=load)
        if step.error is None:
            report(f"compiled {step.name}")


_INPUT_CHECKS_OFF = """
    static bool _check_aoti_runtime_check_inputs_env() {
        const static char* env_var_value = getenv("AOTI_RUNTIME_CHECK_INPUTS");
        const static bool result = env_var_value != nullptr && env_var_value[0] != '0';
        return result;
    }

    AOTI_NOINLINE static void __check_inputs_outputs(AtenTensorHandle* input_handles,
                                                     AtenTensorHandle* output_handles) {}
"""


def _leave_out_input_checks() -> None:
    """AOTInductor writes a check of every input's dtype, sizes, strides and device into the
    wrapper, run only when AOTI_RUNTIME_CHECK_INPUTS is set: with a step's ~370 inputs (every
    weight and K/V buffer) that is ~26 000 of its ~32 000 lines of C++, and half of g++'s time on
    it (SmolLM2's one-row step: 21 s -> 11 s). The engine makes the inputs itself, so the checks
    are left out: the functions the wrapper calls stay, and do nothing. Only in the child that
    builds a package (a torch without this method builds with the checks)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    if hasattr(CppWrapperCpu, "generate_input_output_runtime_checks"):
        CppWrapperCpu.generate_input_output_runtime_checks = lambda self: self.prefix.splice_aot(_INPUT_CHECKS_OFF)


def compile_package(program: str, path: str) -> None:
    """An exported program (torch.export.save) -> an AOTInductor package at `path`, written whole
    or not at all (a worker may be killed mid-build; two may build the same key)."""
    _leave_out_input_checks()
    quants_missing = load_ops()  # the program may call engine/quants' ops: they and their fake kernels
    if quants_missing is not None:
        log.info("engine/quants' kernels not loaded: %s", quants_missing)
    load_ops("strata_attend")
    files = {"inputs.json": ""}
    exported = torch.export.load(program, extra_files=files)
    # inductor reads only the inputs' shapes, strides and dtypes; these are never touched
    exported.example_inputs = (tuple(torch.empty_strided(shape, stride, dtype=getattr(torch, dtype))
                                     for shape, stride, dtype in json.loads(files["inputs.json"])), {})
    fd, scratch = tempfile.mkstemp(suffix=".pt2", prefix="package-", dir=os.path.dirname(path))
    os.close(fd)
    try:
        torch._inductor.aoti_compile_and_package(exported, package_path=scratch)
        os.replace(scratch, path)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child running `python -m engine.…`: this checkout's engine first."""
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])), **extra}


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent exits (a worker killed outright leaves
    no compiler running; a package is renamed into place whole, so none is half-made)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    die_with_parent()
    compile_package(sys.argv[1], sys.argv[2])
