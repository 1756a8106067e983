"""The compiled decode step (engine/compiled.py) and its one-row step compiled ahead of time
(engine/aot.py): on a tiny random model against eager and against each other, and on SmolLM2 as
`strata serve` runs it (compiled is the default). The real model's compiled speed and
compile time are measured by bench/engine_speed.py (`default` vs `default+eager`), never here."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from engine.quants.build import compiler
from engine.runner import TorchEngine
from engine.weights import can_prepack
from tests.helpers.early import packaged
from tests.helpers.tiny_engine import GREEDY, packaged_run, run_four_slots, tiny_engine

def test_compiled_decode_gives_eager_tokens_without_recompiling():
    engine = tiny_engine()
    eager = run_four_slots(engine)
    caches = [t.clone() for block in engine.model.layers for t in block.state()]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine.compile_decode(warm=True, ahead=False)
    # Four graphs: one layer's, that every layer runs, and the head's; each for one row and for
    # 2+ rows with dynamic batch and span. Warming wrote to scratch buffers, not to any slot's cache.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4
    assert all(torch.equal(a, b) for a, b in
               zip(caches, [t for block in engine.model.layers for t in block.state()]))
    with torch._dynamo.config.patch(error_on_recompile=True):  # new batch sizes and spans reuse them
        compiled = run_four_slots(engine)
    assert compiled == eager


def _pair_run(engine: TorchEngine) -> list[list[int]]:
    """Two slots together, then slot 1 alone, within a context of 100."""
    out = {}
    for slot, length in ((0, 20), (1, 5)):
        engine.begin(slot, GREEDY)
        out[slot] = [engine.read(slot, [(3 * i + slot) % 256 for i in range(length)], sample=True)]
    for group, steps in (([0, 1], 30), ([1], 10)):
        for _ in range(steps):
            for slot, new in zip(group, engine.decode(group, [out[s][-1] for s in group])):
                out[slot] += new
    return [out[0], out[1]]


def _counted(engine: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> dict[bool, list[int]]:
    """Calls into each package, by `batched`."""
    calls: dict[bool, list[int]] = {False: [], True: []}
    for packaged in engine.compiled.packaged:
        run = packaged._run
        monkeypatch.setattr(packaged, "_run", lambda inputs, run=run, b=packaged.batched: calls[b].append(1) or run(inputs))
    return calls


def _tiny_packages(folder: Path) -> list[str]:
    """The tiny engine's packages (float32, the head inside), built early (tests/helpers/early.py)."""
    engine = tiny_engine()
    engine.compile_decode(warm=True)
    return packaged(engine)


def _tiny_layers_packages(folder: Path) -> list[str]:
    """The tiny engine's packages without the head, as for a head they cannot hold."""
    from engine import aot

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aot, "head_inside", lambda model: False)
        return _tiny_packages(folder)


@pytest.mark.parametrize("head_inside", [
    pytest.param(True, marks=pytest.mark.early.with_args(_tiny_packages)),
    pytest.param(False, marks=pytest.mark.early.with_args(_tiny_layers_packages))])
def test_steps_ahead_of_time_give_the_per_layer_graphs_tokens(packages, monkeypatch, head_inside):
    """Tokens, and here (float32, small) the K/V they wrote in place bit for bit; on SmolLM2 a
    few logits can come out a bf16 step apart (engine/aot.py), so a worker never mixes them.
    With the head inside the packages no graph is made at all (dynamo never starts); a head the
    packages cannot hold (oneDNN-prepacked) runs as the head's graph after them. The packages
    were built early, in another process (tests/helpers/early.py): found here by their key."""
    from engine import aot

    monkeypatch.setattr(aot, "head_inside", lambda model: head_inside)
    regional, ahead = tiny_engine(), tiny_engine()
    regional.compile_decode(warm=True, ahead=False)
    ahead.compile_decode(warm=True)
    assert not regional.compiled.packaged
    assert [p.path for p in ahead.compiled.packaged] == packages
    assert [p.batched for p in ahead.compiled.packaged] == [False, True]
    assert all(p.ready and p.head is head_inside for p in ahead.compiled.packaged)
    calls = _counted(ahead, monkeypatch)
    assert packaged_run(ahead) == packaged_run(regional)
    assert (len(calls[False]), len(calls[True])) == (70, 60)  # every step went through a package
    graphs = {"_layer", "_head"} & set(vars(ahead.compiled))
    assert graphs == (set() if head_inside else {"_head"})
    for a, b in zip(ahead.model.layers, regional.model.layers):
        assert all(torch.equal(x, y) for x, y in zip(a.state(), b.state(), strict=True))


@pytest.mark.early.with_args(_tiny_packages)
def test_packages_serve_any_slot_count_and_context_and_a_failed_build_leaves_the_per_layer_graphs(
        packages, tmp_path, monkeypatch):
    from engine import aot

    # the build left its two packages alone in the folder (no exported program, no scratch package)
    paths = set(packages)
    assert len(paths) == 2 and {p.name for p in (tmp_path / "strata-aot").iterdir()} == {p.name for p in paths}
    for path in paths:  # the checks of every input (run only under AOTI_RUNTIME_CHECK_INPUTS) are not compiled in
        with zipfile.ZipFile(path) as package:
            wrapper = next(package.read(n).decode() for n in package.namelist() if n.endswith(".wrapper.cpp"))
        assert "__check_inputs_outputs" in wrapper and "check_input_0" not in wrapper

    def no_export(self):
        raise AssertionError("exported although the package was cached")

    with monkeypatch.context() as patch:  # same shapes: loaded, neither exported nor compiled
        patch.setattr(aot.PackagedStep, "export", no_export)
        again = tiny_engine()
        again.compile_decode(warm=True)
        assert {p.path for p in again.compiled.packaged} == paths and all(p.ready for p in again.compiled.packaged)
        # another slot count and context (the K/V buffers' sizes are dynamic): the same packages
        wider, two = tiny_engine(num_slots=6, ctx=700), tiny_engine(num_slots=2, ctx=100)
        for engine in (wider, two):
            engine.compile_decode(warm=True)
            assert {p.path for p in engine.compiled.packaged} == paths
            assert all(p.ready for p in engine.compiled.packaged)
    regional, small = tiny_engine(num_slots=6, ctx=700), tiny_engine(num_slots=2, ctx=100)
    for engine in (regional, small):
        engine.compile_decode(warm=True, ahead=False)
    assert packaged_run(wider) == packaged_run(regional)
    assert _pair_run(two) == _pair_run(small)
    # only the one-row package cached (as a build killed half-way leaves it): loaded; the batched
    # one is built and fails, so neither is used
    fresh = tmp_path / "fresh"
    (fresh / "strata-aot").mkdir(parents=True)
    shutil.copy(packages[0], fresh / "strata-aot")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(fresh))
    real, built = aot.PackagedStep.start_build, []
    monkeypatch.setattr(aot.PackagedStep, "start_build", lambda self, program: built.append(self.batched) or real(
        self, program if not self.batched else str(tmp_path / "missing.pt2")))
    other, reference = tiny_engine(num_slots=5), tiny_engine(num_slots=5)
    other.compile_decode(warm=True)
    reference.compile_decode(warm=True, ahead=False)
    assert built == [True]  # the one-row package was loaded, not built again
    assert other.compiled.packaged == [] and not list((fresh / "strata-aot").glob("exported-*"))
    assert packaged_run(other) == packaged_run(reference)


def _quant_engine(path) -> TorchEngine:
    """A GGUF file's model as the CPU default builds it (bf16, every quantized type as blocks)."""
    from engine.gguf_loader import GGUFModel
    from engine.model import Transformer

    loaded = GGUFModel(path)
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=torch.device("cpu"), int4=True)
    model.allocate_cache(num_slots=2, ctx=100)
    return TorchEngine(model, None, eos_token_ids=frozenset())


def _mix_packages(folder: Path) -> list[str]:
    """The packages of test_a_mix_decodes_compiled_ahead_of_time_as_eagerly's file, built early."""
    from tests.helpers.quant_models import write_mix

    write_mix(folder / "tiny-mixed.gguf", "Q4_K_M+Q8_0")
    engine = _quant_engine(folder / "tiny-mixed.gguf")
    engine.compile_decode(warm=True)
    return packaged(engine)


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler: engine/quants' kernels cannot be built")
@pytest.mark.early.with_args(_mix_packages)
def test_a_mix_decodes_compiled_ahead_of_time_as_eagerly(packages, tmp_path, monkeypatch):
    """A K-quant file (Q4_K_M's Q4_K and Q6_K v/down and head, with Q8_0 and Q5_0 parts
    beside them in one linear) decodes through the per-layer graphs and through the packages
    (the head inside) with eager's greedy tokens, one row and two: the file's blocks go in as
    the graphs' inputs, `strata_quants::mm` called from them."""
    from engine import aot
    from engine.compiled import compilable
    from engine.quants.blocks import BlocksPart, QuantLinear
    from tests.helpers.quant_models import write_mix

    torch._dynamo.reset()  # this model's layer graphs (two kinds, one row and 2+) within the recompile limit
    path = tmp_path / "tiny-mixed.gguf"
    write_mix(path, "Q4_K_M+Q8_0")
    eager, regional, ahead = (_quant_engine(path) for _ in range(3))
    linears = [m for m in eager.model.modules() if isinstance(m, QuantLinear)]
    kinds = {p.qtype.name if isinstance(p, BlocksPart) else "int4" for m in linears for p in m.parts}
    assert kinds == {"Q4_K", "Q6_K", "Q8_0", "Q5_0"} and isinstance(eager.model.head, QuantLinear)
    assert compilable(eager.model) and aot.head_inside(eager.model)
    regional.compile_decode(warm=True, ahead=False)
    ahead.compile_decode(warm=True)
    assert all(p.ready and p.head for p in ahead.compiled.packaged) and len(ahead.compiled.packaged) == 2
    assert [p.path for p in ahead.compiled.packaged] == packages  # those built in another process
    calls = _counted(ahead, monkeypatch)
    want = _pair_run(eager)
    assert _pair_run(regional) == want
    assert _pair_run(ahead) == want
    assert (len(calls[False]), len(calls[True])) == (10, 30)
    assert "_layer" not in vars(ahead.compiled) and "_head" not in vars(ahead.compiled)


def _default_packages(folder: Path) -> list[str]:
    """SmolLM2's packages as `strata serve` builds them on the CPU (the default engine), built early."""
    from engine.load import load_engine

    return packaged(load_engine(None, num_slots=4, ctx=512, cache_dir=folder))


@pytest.mark.smollm2
@pytest.mark.timeout(1800)  # may wait for SmolLM2's packages: ~10 min on 2 busy cores, past the 600 s default
@pytest.mark.early.with_args(_default_packages)
def test_default_engine_decodes_compiled_and_a_row_does_not_depend_on_its_neighbours(packages, tmp_path):
    """Compiled and eager greedy tokens can part at near-ties (bf16 rounding inside fused
    kernels; docs/engine.md), so a worker never mixes them: the default compiles at load, and a
    request's tokens must be the same whatever else shares its step (alone, a row goes through
    the one-row package compiled ahead of time; with others, through the batched one): its
    logits, bit for bit. Alone, a row also checks guessed tokens (prompt lookup, the default):
    a confirmed guess is a second row of the batched package, and gives the same tokens. The
    packages are built early by another process (`_default_packages`, the same `load_engine`;
    tests/helpers/early.py), and loaded here as a restart loads them."""
    from engine.load import load_engine
    from tests.helpers.logprobs import assert_exact_logprobs

    engine = load_engine(None, num_slots=4, ctx=512, cache_dir=tmp_path)
    assert engine.compiled is not None and [p.batched for p in engine.compiled.packaged] == [False, True]
    assert [p.path for p in engine.compiled.packaged] == packages  # built by another process: found by their key
    # the int8 head and its bound inside the packages: no graph of the head's own
    assert all(p.ready and p.head for p in engine.compiled.packaged) and "_head" not in vars(engine.compiled)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in
               ("What is the capital of France?", "Write a short poem about the sea.", "What is 17 times 23?",
                "Say the word hello twelve times.")]

    two = []

    def greedy(group: list[int], length: int = 40) -> list[list[int]]:
        out = {}
        for slot in group:
            engine.begin(slot, GREEDY)
            out[slot] = [engine.read(slot, prompts[slot], sample=True)]
        while any(len(out[s]) < length for s in group):
            for slot, new in zip(group, engine.decode(group, [out[s][-1] for s in group])):
                out[slot] += new
                two.append(len(new) > 1)
        return [out[s][:length] for s in group]

    assert engine.prompt_lookup
    with torch._dynamo.config.patch(error_on_recompile=True):  # warmed at load: batch 1 and 2+
        together = greedy([0, 1, 2, 3])
        assert not any(two)  # several rows: no guessing
        alone = [greedy([slot])[0] for slot in range(4)]
        assert sum(two) >= 3, sum(two)  # guesses confirmed
        pair = greedy([3, 1])
    assert together == alone
    assert pair == [alone[3], alone[1]]
    with torch.inference_mode():
        def logits(group: list[int]) -> torch.Tensor:
            return engine.compiled(torch.tensor([5] * len(group)), torch.tensor(group),
                                   torch.tensor([engine.position(s) for s in group]), 256)

        together = logits([0, 1, 2, 3])
        for slot in range(4):
            assert torch.equal(logits([slot])[0], together[slot])
    # logprobs through the packages: every entry the float32 head's on the step's own residual
    assert_exact_logprobs(engine, prompts[1], steps=12)


@pytest.mark.skipif(not can_prepack(), reason="oneDNN cannot prepack bf16 on this CPU (AVX2 alone): no prepacked linears")
def test_prepacked_linears_decode_eagerly_instead_of_failing_to_compile(tiny_model):
    """bf16 without int4 (`--no-int4`, a Q8_0 file) keeps oneDNN-prepacked linears, which
    inductor cannot lower: the default (compile) must still load and decode, eagerly."""
    from engine.load import load_engine

    engine = load_engine(tiny_model, num_slots=2, ctx=256, dtype="bfloat16", threads=1)
    assert engine.model.forms.get("bf16-packed") and engine.compiled is None
    engine.begin(0, GREEDY)
    first = engine.read(0, [1, 2, 3, 4], sample=True)
    assert len(engine.decode([0], [first])) == 1


def test_packages_are_kept_under_inductors_cache_folder_as_an_absolute_path(monkeypatch, tmp_path):
    """A relative --data-dir (TORCHINDUCTOR_CACHE_DIR) is resolved once: the build runs in a
    child process and the path is logged."""
    from engine import aot

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "relative/inductor")
    assert aot.package_folder() == tmp_path / "relative" / "inductor" / "strata-aot"


_COMPILE_WORKERS = """
import os, sys
from pathlib import Path
from torch._inductor.async_compile import AsyncCompile
from tests.helpers.tiny_engine import run_four_slots, tiny_engine

def sidecars():  # inductor's compile-worker sidecar: a child of this process
    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid() and b"compile_worker" in (entry / "cmdline").read_bytes():
                found.append(entry.name)
        except (OSError, ValueError, IndexError):
            pass
    return found

engine = tiny_engine()
AsyncCompile.warm_pool()
print(len(sidecars()))
engine.compile_decode(warm=True, ahead=False)
print(len(sidecars()))
print(run_four_slots(engine) == run_four_slots(tiny_engine()))  # compiled after the shutdown, and eager
"""


def test_the_compile_workers_go_once_the_step_is_compiled(tmp_path):
    """Inductor's compile processes are shut down once the step is compiled (on a GPU machine
    they took about a core while the worker served), and the steps after that still give eager's
    tokens. Two
    compile threads so that inductor starts its pool here too (on 2 cores it may not)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _COMPILE_WORKERS], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "0", "True"]
