"""The one-row decode step compiled ahead of time: every layer in one C++ call.

At one row, calling each layer's compiled graph from Python costs about as much as the layer's
arithmetic: dynamo's guards, the wrapper's allocations and calls, ~80 of ~230 us a layer on this
machine. AOTInductor compiles the stack of layers — the graph inductor builds for one layer,
repeated — into a shared library with a C++ wrapper that a step calls once (SmolLM2's 30 layers:
3.9 ms against 7.1 ms). Its kernels are the regional one-row graph's kernels, so its results are
the same bit for bit (tests/engine/test_aot.py): a worker serves with the regional graph while the
package builds, then switches, and no request's text depends on when.

The weights and K/V buffers are the package's inputs, not constants: the package holds only code
(a few MB), runs on the model's own tensors and writes the K/V buffers in place. Packages are kept
under inductor's cache folder (`--data-dir`/cache/inductor/strata-aot) by a key of everything the
code depends on: torch, this engine's source, the tensors' shapes and strides, the CPU's vector
instructions. Export takes seconds and swaps the model's tensors for traced inputs, so it runs
before serving; the compile (~45 s cold for SmolLM2) runs in a child process (`python -m
engine.aot`), whose torch marks itself as compiling/exporting in flags a serving thread would see.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from engine.model import CacheIndex, Transformer
from engine.weights import PackedLinear

log = logging.getLogger(__name__)

READY_LOG = "compiled ahead of time, ready"  # bench/side_by_side.py waits for it
FORMAT = "1"  # bump when what a package is called with changes
_SOURCES = ("model.py", "weights.py", "aot.py")


def _step_tensors(model: Transformer) -> list[tuple[nn.Module, str]]:
    """Every tensor the layers read at one token per row, as (module, attribute): the package's
    inputs after the step's own. A bf16 prepacked copy serves only prefill chunks: left out."""
    found = []
    for block in model.layers:
        for module in block.modules():
            if isinstance(module, PackedLinear):
                continue
            for name, value in vars(module).items():
                if isinstance(value, Tensor) and value.layout == torch.strided and value.numel() > 0:
                    found.append((module, name))
    return found


class _Layers(nn.Module):
    """The layers as a function of their tensors, for export: each call puts the given tensors
    where the layers look for them, so the traced graph takes them as inputs."""

    def __init__(self, model: Transformer, places: list[tuple[nn.Module, str]]) -> None:
        super().__init__()
        self.model, self.places = model, places

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, rows: Tensor, positions: Tensor, mask: Tensor,
                *tensors: Tensor) -> Tensor:
        kept = [getattr(module, name) for module, name in self.places]
        for (module, name), tensor in zip(self.places, tensors):
            setattr(module, name, tensor)
        try:
            index = CacheIndex(0, self.model.num_slots, mask.shape[-1], rows, positions, sliced=False)
            for block in self.model.layers:
                x = block(x, cos, sin, block.k_cache, block.v_cache, index, mask)
            return x
        finally:
            for (module, name), tensor in zip(self.places, kept):
                setattr(module, name, tensor)


def example_inputs(model: Transformer, rows: int, span: int) -> tuple[Tensor, ...]:
    """The step's own inputs for `rows` rows: x [B, 1, dim] float32, cos, sin [B, 1, hd], rows,
    positions [B, 1] long, mask [B, 1, 1, 1, span] bool."""
    slots = torch.arange(rows, device=model.device).unsqueeze(1)
    positions = torch.zeros(rows, 1, dtype=torch.long, device=model.device)
    x = torch.zeros(rows, 1, model.cfg.dim, device=model.device)
    cos, sin = model.rope(positions)
    mask = CacheIndex(0, model.num_slots, span, slots, positions, sliced=False).mask()
    return x, cos, sin, slots, positions, mask


def package_key(model: Transformer, batched: bool, tensors: list[Tensor]) -> str:
    from torch._inductor import cpu_vec_isa

    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    parts = [FORMAT, "batched" if batched else "one row", torch.__version__, repr(model.cfg), str(model.dtype),
             str(model.num_slots), str(model.ctx), str(cpu_vec_isa.pick_vec_isa()),
             str(torch.backends.cpu.get_cpu_capability())]
    parts += [f"{tuple(t.shape)}{t.stride()}{t.dtype}" for t in tensors]
    digest.update("\n".join(parts).encode())
    return digest.hexdigest()[:32]


def _package_folder() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "strata-aot"


class PackagedLayers:
    """A decode step's layers from an AOTInductor package: one row, or (`batched`) 2 to
    num_slots rows; `ready` once loaded. Until then callers use the per-layer graph, whose
    results these are, bit for bit."""

    def __init__(self, model: Transformer, batched: bool) -> None:
        self.model, self.batched = model, batched
        self.name = "batched step" if batched else "one-row step"
        self.places = _step_tensors(model)
        self.tensors = [getattr(module, name) for module, name in self.places]
        self._run: Callable[[list[Tensor]], list[Tensor]] | None = None
        self.error: BaseException | None = None
        self.path = _package_folder() / f"{package_key(model, batched, self.tensors)}.pt2"

    @property
    def ready(self) -> bool:
        return self._run is not None

    def fits(self, rows: int, span: int) -> bool:
        return (rows >= 2 if self.batched else rows == 1) and rows <= self.model.num_slots and 2 <= span <= self.model.ctx

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, rows: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        """x: [B, 1, dim] float32 residual -> after every layer (Block.forward's contract)."""
        assert self._run is not None
        return self._run([x, cos, sin, rows, positions, mask, *self.tensors])[0]

    def load_cached(self) -> bool:
        if not self.path.exists():
            return False
        try:
            self._load()
            return True
        except Exception:  # not a package this torch can load: build it again
            log.warning("could not load %s; building it again", self.path, exc_info=True)
            return False

    def export(self) -> str:
        """Trace the layers (the model's tensors are swapped for the trace's inputs meanwhile, so
        nothing may run the model concurrently) and save the program for `build`."""
        started = time.perf_counter()
        rows = 2 if self.batched else 1
        inputs = example_inputs(self.model, rows, min(self.model.ctx, 256))
        span = torch.export.Dim("span", min=2, max=self.model.ctx)
        if self.batched:
            batch = torch.export.Dim("batch", min=2, max=self.model.num_slots)
            dims: list[Any] = [{0: batch} for _ in inputs]
            dims[-1] = {0: batch, 4: span}
        else:
            dims = [None] * len(inputs)
            dims[-1] = {4: span}
        with torch.inference_mode():
            exported = torch.export.export(_Layers(self.model, self.places), (*inputs, *self.tensors),
                                           dynamic_shapes=(*dims, tuple(None for _ in self.tensors)))
        shapes = [(tuple(t.shape), t.stride(), str(t.dtype).removeprefix("torch.")) for t in exported.example_inputs[0]]
        exported.example_inputs = None  # the weights and K/V buffers themselves: ~1 GB to write for nothing
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, program = tempfile.mkstemp(suffix=".pt2", prefix="exported-", dir=self.path.parent)
        os.close(fd)
        torch.export.save(exported, program, extra_files={"inputs.json": json.dumps(shapes)})
        log.info("exported the %s in %.1fs", self.name, time.perf_counter() - started)
        return program

    def build(self, program: str) -> None:
        """Compile the exported program in a child process, then load it; on failure the
        per-layer graph keeps serving."""
        started = time.perf_counter()
        try:
            try:
                root = str(Path(__file__).resolve().parent.parent)
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
                done = subprocess.run([sys.executable, "-m", "engine.aot", program, str(self.path)],
                                      capture_output=True, text=True, env=env)
            finally:
                os.unlink(program)
            if done.returncode != 0:
                raise RuntimeError(f"python -m engine.aot exited with {done.returncode}: {done.stderr[-2000:]}")
            log.info("%s compiled ahead of time in %.1fs", self.name, time.perf_counter() - started)
            self._load()
        except Exception as error:
            self.error = error
            log.warning("compiling the %s ahead of time failed; staying on the per-layer graph", self.name,
                        exc_info=True)

    def _load(self) -> None:
        runner = torch._inductor.aoti_load_package(str(self.path))
        self._run = runner.loader.boxed_run
        log.info("%s: %s (%s)", READY_LOG, self.name, self.path.name)


def prepare(model: Transformer, wait: bool = True) -> tuple[list[PackagedLayers], threading.Thread | None]:
    """The one-row and the batched step's packages: loaded where cached, the others exported now
    and compiled now (`wait`) or one after the other in a background thread (returned)."""
    steps = [PackagedLayers(model, batched=False)]
    if model.num_slots > 1:
        steps.append(PackagedLayers(model, batched=True))
    pending = [(step, step.export()) for step in steps if not step.load_cached()]

    def build_all() -> None:
        for step, program in pending:
            step.build(program)

    if not pending or wait:
        build_all()
        return steps, None
    thread = threading.Thread(target=build_all, name="strata-aot", daemon=True)
    thread.start()
    return steps, thread


def compile_package(program: str, path: str) -> None:
    """An exported program (torch.export.save) -> an AOTInductor package at `path`, written whole
    or not at all (a worker may be killed mid-build; two may build the same key)."""
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


if __name__ == "__main__":
    compile_package(sys.argv[1], sys.argv[2])
