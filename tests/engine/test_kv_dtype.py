"""What the KV pool stores (`--kv-dtype`, engine/kv_dtype.py): float32, float16 (the CPU default under
bf16 activations), bfloat16, int8 with a scale per token and head, fp8 on CUDA only. The entries'
round trip and bytes, and a tiny random model's answers read from a float16, bf16 or int8 pool
against the float32 pool's, step by step on the same tokens."""

from __future__ import annotations

import pytest
import torch

from engine import kv_dtype
from engine.errors import ConfigError
from engine.load import build_engine
from engine.model import KV_BLOCK, ModelConfig
from engine.protocol import SamplingParams
from tests.helpers.early import packaged
from tests.helpers.tiny_engine import TINY, run_four_slots, tiny_weights
from workers.settings import WorkerSettings

SCORED = SamplingParams(temperature=0.0, logprobs=5)
CPU = torch.device("cpu")
# The stated cost against float32, in nats, on every top-5 logprob of 40 steps (measured on this
# model: float16 0.0005, bf16 0.005, int8 0.019 at the worst step; docs/kv_pool.md has SmolLM2's numbers).
TOLERANCE = {"float16": 0.001, "bfloat16": 0.01, "int8": 0.04}
WEIGHT = 0.1  # random linears at this scale: logits about as calm as a trained model's (at 0.2, bf16 moved them 0.2 nats)


def test_entries_round_trip_within_their_dtypes_step_and_say_their_bytes():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 64) * torch.logspace(-3, 2, 7).view(1, 1, 7, 1)  # ranges per token far apart
    peak = x.abs().amax(dim=-1, keepdim=True)
    assert torch.equal(kv_dtype.load(kv_dtype.store(x, torch.float32), 64), x)
    assert ((kv_dtype.load(kv_dtype.store(x, torch.bfloat16), 64) - x).abs() <= x.abs() * 2**-8).all()
    # float16: 11 significant bits where x is a normal float16 (|x| >= 2^-14), half a step of 2^-24 below
    half = kv_dtype.load(kv_dtype.store(x, torch.float16), 64)
    assert half.dtype == torch.float32 and ((half - x).abs() <= torch.maximum(x.abs() * 2**-11, torch.tensor(2.0**-25))).all()
    # past float16's range a value is kept at its end, 65 504, never infinity
    assert kv_dtype.store(torch.tensor([7e4, -1e6, 65504.0, 1.5]), torch.float16).tolist() == [65504, -65504, 65504, 1.5]
    int8 = kv_dtype.store(x, torch.int8)
    assert int8.dtype == torch.int8 and int8.shape == (2, 3, 7, 68)  # the values, then a float32 scale
    # a scale per token and head: each entry within half a step of its own token's range
    assert ((kv_dtype.load(int8, 64) - x).abs() <= peak / 127 * 0.5 * (1 + 1e-5)).all()
    assert [kv_dtype.entry_bytes(64, d) for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8)] == [256, 128, 128, 68]
    smol = ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden_dim=1536, vocab_size=49152)
    assert [smol.kv_bytes_per_token(d) for d in (torch.float32, torch.float16, torch.int8)] == [46080, 23040, 12240]
    assert smol.kv_cache_bytes(8192, torch.int8) == (8192 + KV_BLOCK) * 12240


def test_fp8_is_refused_off_cuda_and_unknown_names_are_refused():
    with pytest.raises(ConfigError, match="--kv-dtype fp8 needs a CUDA device .* use int8"):
        kv_dtype.resolve("fp8", CPU, torch.float32)
    with pytest.raises(ConfigError, match="unsupported --kv-dtype 'q4'"):
        kv_dtype.resolve("q4", CPU, torch.float32)
    # the CPU default: float16 under bf16 activations, float32 on the float32 (exact) path
    assert kv_dtype.resolve("auto", CPU, torch.bfloat16) == torch.float16
    assert kv_dtype.resolve(None, CPU, torch.float32) == torch.float32
    assert kv_dtype.resolve("float16", CPU, torch.float32) == torch.float16
    assert kv_dtype.resolve(None, torch.device("cuda", 0), torch.bfloat16) == torch.bfloat16
    with pytest.raises(ConfigError, match="fp8 needs a CUDA device"):
        _engine("fp8")


def test_the_flag_and_its_variable(monkeypatch):
    assert WorkerSettings().kv_dtype == "auto"
    monkeypatch.setenv("STRATA_KV_DTYPE", "int8")
    assert WorkerSettings().kv_dtype == "int8"


def _engine(kv: str | None, num_slots: int = 2):
    return build_engine(TINY, tiny_weights(WEIGHT), None, num_slots=num_slots, ctx=320, device=CPU,
                        dtype=torch.float32, eos_token_ids=frozenset(), kv_dtype=kv)


def _forced(engine, prompt: list[int], answer: list[int]) -> list[dict[int, float]]:
    """Each step's top-5 logprobs when the answer's tokens are fed whatever the engine picks."""
    engine.begin(1, SCORED)
    engine.read(1, prompt, sample=True)
    for token in answer[:-1]:
        engine.decode([1], [token])
    return [{t: lp for t, lp in score.top} for score in engine.logprobs(1)]


@pytest.mark.parametrize("kv", ["float16", "bfloat16", "int8"])
def test_a_narrow_pool_answers_within_its_stated_cost_of_the_float32_pool(kv):
    prompt = [(11 * i + 5) % 256 for i in range(150)]  # past two blocks, a read in one chunk
    exact = _engine(None)
    assert exact.model.cache_dtype == torch.float32
    exact.begin(1, SCORED)
    out = [exact.read(1, prompt, sample=True)]
    while len(out) < 40:
        out += exact.decode([1], [out[-1]])[0]
    reference = _forced(exact, prompt, out)
    narrow = _engine(kv)
    assert narrow.model.cache_dtype == getattr(torch, kv)
    assert narrow.model.kv_bytes() == 2 * 2 * 2 * (exact.kv_tokens + KV_BLOCK) * kv_dtype.entry_bytes(16, getattr(torch, kv))
    got = _forced(narrow, prompt, out)
    assert len(got) == len(reference) == 40
    worst = max(abs(step[t] - ref[t]) for step, ref in zip(got, reference) for t in ref.keys() & step.keys())
    assert 0 < worst <= TOLERANCE[kv], worst  # not bit-exact (the entries are narrower), within the cost
    assert sum(len(ref.keys() & step.keys()) for step, ref in zip(got, reference)) >= 0.95 * 5 * 40


def _int8_packages(folder) -> list[str]:
    """The packages of an int8 pool's tiny engine, built early (tests/helpers/early.py)."""
    engine = _engine("int8", num_slots=4)
    engine.compile_decode(warm=True)
    return packaged(engine)


@pytest.mark.parametrize("ahead", [False, pytest.param(True, marks=pytest.mark.early.with_args(_int8_packages))],
                         ids=["per-layer graphs", "packages ahead of time"])
def test_an_int8_pool_compiled_gives_the_eager_tokens(ahead, packages):
    """The per-layer graphs and the packages compiled ahead of time (the default's step) run the
    same store/load (the scale in the entry's last bytes: still one K and one V buffer a layer,
    so the steps' inputs are as before). A cache folder of the test's own (`packages`): only the
    packages built for this model, in another process, found by their key."""
    eager = run_four_slots(_engine("int8", num_slots=4))
    engine = _engine("int8", num_slots=4)
    torch._dynamo.reset()
    engine.compile_decode(warm=True, ahead=ahead)
    assert engine.compiled is not None
    assert [p.ready for p in engine.compiled.packaged] == ([True, True] if ahead else [])
    assert [p.path for p in engine.compiled.packaged] == packages
    assert run_four_slots(engine) == eager
