"""Qwen3-Next (the hybrid: Gated DeltaNet layers with a recurrent state per slot between gated
attention layers with partial RoPE, routed + shared experts) against transformers, from an HF
folder and from GGUFs written here under llama.cpp's names (float32 and Q8_0); and the rules a
state that cannot go back imposes on the engine (docs/engine.md, "Recurrent state")."""

from __future__ import annotations

import pytest
import torch

from engine import hf_loader
from engine.model import Transformer
from engine.protocol import SamplingParams
from engine.quants.build import compiler
from engine.runner import TorchEngine
from engine.weights import DictSource
from tests.helpers.early import packaged
from tests.helpers.family_gguf import qwen3next_gguf, with_norms_and_routers_counting
from tests.helpers.hf_reference import check_engine_greedy, check_prefill_and_decode, hf_greedy

KINDS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def qwen3_next(v_heads: int = 4, tied: bool = False, shared: int = 48, kinds: list[str] = KINDS):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(
        hidden_size=64, num_hidden_layers=len(kinds), layer_types=kinds, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=shared, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, linear_num_key_heads=2, linear_num_value_heads=v_heads,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25  # RoPE on 4 of each head's 16 dims
    return with_norms_and_routers_counting(Qwen3NextForCausalLM(cfg))


def built(hf, tmp_path, num_slots: int = 4) -> Transformer:
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = hf_loader.read_config(tmp_path)
    model = Transformer.build(cfg, DictSource(hf_loader.load_weights(tmp_path)), dtype=torch.float32,
                              device=torch.device("cpu"))
    model.allocate_cache(num_slots=num_slots, ctx=256)
    return model


VARIANTS = {"grouped": {}, "one-value-head-a-key-head-tied": {"v_heads": 2, "tied": True}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_folder_matches_transformers(variant, tmp_path):
    hf = qwen3_next(**VARIANTS[variant])
    model = built(hf, tmp_path)
    cfg = model.cfg
    assert cfg.linear_layers == (True, False, True, False) and cfg.rotary_dim == 4 and cfg.attn_gate
    assert cfg.recurrent and cfg.n_attention_layers == 2
    assert model.forms["experts"] == 4  # every layer's FFN: routed + shared experts
    # K/V pools only for the attention layers; the state per slot (and a spare row) for the others
    assert model.slot_kv(0, 3).shape[0] == 2
    assert model.layers[0].mixer.ssm_state.shape == (5, cfg.linear.n_v_heads, 16, 16)
    check_prefill_and_decode(hf, model)  # chunks of 16, 1, 33, 20 into one slot; then batched decode
    check_engine_greedy(hf, model)


def test_partial_rope_matters(tmp_path):
    # the same weights with RoPE over the whole head leave transformers: the test sees the quarter
    from dataclasses import replace

    hf = qwen3_next()
    model = built(hf, tmp_path)
    other = Transformer.build(replace(model.cfg, rotary_dim=0), DictSource(hf_loader.load_weights(tmp_path)),
                              dtype=torch.float32, device=torch.device("cpu"))
    other.allocate_cache(num_slots=4, ctx=256)
    with pytest.raises(AssertionError):
        check_prefill_and_decode(hf, other)


# ---- the recurrent state in the engine ------------------------------------------------------

def _engine(model: Transformer) -> TorchEngine:
    return TorchEngine(model, None, eos_token_ids=frozenset())


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_read_that_gives_way_parks_its_state_and_continues_from_it(tmp_path):
    hf = qwen3_next()
    engine = _engine(built(hf, tmp_path))
    parked, urgent = _prompt(40, 1), _prompt(25, 2)
    engine.begin(1, SamplingParams(temperature=0.0))
    assert engine.read(1, parked[:16], sample=False) is None  # gives way at a chunk boundary
    engine.begin(0, SamplingParams(temperature=0.0))
    out = [engine.read(0, urgent, sample=True)]
    for _ in range(3):  # the urgent request decodes beside nothing; slot 1's state stays parked
        out += engine.decode([0], [out[-1]])[0]
    assert out == hf_greedy(hf, urgent, 4)
    answer = [engine.read(1, parked[16:], sample=True)]  # the rest, from the parked state
    for _ in range(3):
        both = engine.decode([1, 0], [answer[-1], out[-1]])  # batched with the other slot
        answer += both[0]
        out += both[1]
    assert answer == hf_greedy(hf, parked, 4)
    assert out == hf_greedy(hf, urgent, 7)


def test_a_slot_starts_again_from_zeros_and_never_goes_back(tmp_path):
    hf = qwen3_next()
    engine = _engine(built(hf, tmp_path))
    first, second = _prompt(30, 3), _prompt(20, 4)
    assert not engine.rewinds and not engine.can_look_up
    with pytest.raises(ValueError, match="two slots"):
        engine.use_prompt_lookup()
    engine.begin(2, SamplingParams(temperature=0.0))
    engine.read(2, first, sample=True)
    with pytest.raises(ValueError, match="cannot go back"):
        engine.begin(2, SamplingParams(temperature=0.0), keep=16)  # a shared prefix of the next prompt
    with pytest.raises(ValueError, match="cannot go back"):
        engine.truncate(2, 29)  # a wrong guess taken back
    # the whole of what the slot holds may be kept: its state is exactly there
    engine.begin(2, SamplingParams(temperature=0.0), keep=30)
    assert [engine.read(2, second, sample=True)] == hf_greedy(hf, first + second, 1)
    # the next request in the slot reads from position 0: from zeros, not from what was there
    engine.begin(2, SamplingParams(temperature=0.0))
    assert [engine.read(2, second, sample=True)] == hf_greedy(hf, second, 1)


def test_entries_another_slot_computed_are_not_a_state(tmp_path):
    # the KV pool may hand a slot cached prefix blocks (engine.assign with their tokens): their K/V
    # are right, but no recurrent state goes with them, so reading on from there is refused
    hf = qwen3_next()
    engine = _engine(built(hf, tmp_path))
    prompt = _prompt(70, 5)
    engine.begin(0, SamplingParams(temperature=0.0))
    engine.read(0, prompt, sample=False)
    engine.assign(1, engine._tables[0][:1], prompt[:64])
    with pytest.raises(ValueError, match="carries no recurrent state"):
        engine.begin(1, SamplingParams(temperature=0.0), keep=64)


def test_replayed_answer_and_forked_answers_carry_the_state(tmp_path):
    hf = qwen3_next()
    engine = _engine(built(hf, tmp_path))
    prompt = _prompt(33, 6)
    want = hf_greedy(hf, prompt, 6)
    # a resumed request: the prompt, then the answer so far as decode rows (one a step: rows of one
    # step do not see each other's state), then the next token
    engine.begin(3, SamplingParams(temperature=0.0))
    engine.read(3, prompt, sample=False)
    assert engine.replay(3, want[:4], sample=True) == want[4]
    # n answers from one read: the siblings start from a copy of the read's state
    engine.begin(0, SamplingParams(temperature=0.0))
    engine.begin(1, SamplingParams(temperature=0.0))
    engine.begin(2, SamplingParams(temperature=0.0))
    first = engine.read(0, prompt, sample=True)
    assert engine.fork(0, [1, 2]) == [first, first] == [want[0]] * 2
    tokens = {0: [first], 1: [first], 2: [first]}
    for _ in range(3):
        for slot, new in zip((2, 0, 1), engine.decode([2, 0, 1], [tokens[s][-1] for s in (2, 0, 1)])):
            tokens[slot] += new
    assert tokens[0] == tokens[1] == tokens[2] == want[:4]


# ---- GGUF, as llama.cpp's converter lays Qwen3-Next out (tests/helpers/family_gguf.py) ---------

@pytest.mark.parametrize("layout", ["ssm_in", "attn_qkv"])
@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_gguf_matches_transformers(qtype, layout, tmp_path):
    from gguf import GGMLQuantizationType as Q

    from engine.gguf_loader import GGUFModel

    hf = qwen3_next()
    path = tmp_path / "qwen3next.gguf"
    held = qwen3next_gguf(path, hf, Q.Q8_0 if qtype == "q8_0" else Q.F32, legacy=layout == "ssm_in")
    hf.load_state_dict(held, strict=True)  # the reference: transformers on the file's own weights
    loaded = GGUFModel(path)
    stored = {t.name: t.qtype for t in loaded.file.tensors.values()}
    if qtype == "q8_0":
        assert stored["blk.1.attn_q.weight"] == stored["blk.0.ffn_gate_exps.weight"] == Q.Q8_0
        assert stored["blk.0.ssm_in.weight" if layout == "ssm_in" else "blk.0.attn_qkv.weight"] == Q.Q8_0
    assert loaded.config.linear_layers == (True, False, True, False) and loaded.config.rotary_dim == 4
    model = Transformer.build(loaded.config, loaded, dtype=torch.float32, device=torch.device("cpu"))
    model.allocate_cache(num_slots=4, ctx=256)
    check_prefill_and_decode(hf, model)
    check_engine_greedy(hf, model)


def test_bf16_from_a_q8_0_gguf_stays_close(tmp_path):
    # the CPU's default: bf16 activations, the file's Q8_0 blocks where the kernels take them,
    # routing, attention and the DeltaNet's state in float32
    from gguf import GGMLQuantizationType as Q

    from engine.gguf_loader import GGUFModel

    hf = qwen3_next()
    path = tmp_path / "q8.gguf"
    hf.load_state_dict(qwen3next_gguf(path, hf, Q.Q8_0, legacy=False), strict=True)
    loaded = GGUFModel(path)
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=torch.device("cpu"), int4=True)
    model.allocate_cache(num_slots=4, ctx=256)
    assert model.layers[0].mixer.ssm_state.dtype == torch.float32
    check_prefill_and_decode(hf, model, atol=0.1)


def _cpu_default(path, num_slots: int = 4) -> TorchEngine:
    """A GGUF's model as the CPU default builds it: bf16, the file's blocks through engine/quants."""
    from engine.gguf_loader import GGUFModel

    loaded = GGUFModel(path)
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=torch.device("cpu"), int4=True,
                              prefill_bf16=True)
    model.allocate_cache(num_slots=num_slots, ctx=256)
    return _engine(model)


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler: engine/quants' kernels cannot be built")
@pytest.mark.parametrize("layout", ["ssm_in", "attn_qkv"])
def test_split_parts_are_rows_of_the_files_blocks(layout, tmp_path):
    # q / q_gate and the DeltaNet's qkv / z / b / a are split out of the file's tensors: on the CPU
    # default they are those tensors' rows of blocks, so every layer's linear is engine/quants' and
    # the step compiles (as dense copies they were oneDNN-prepacked bf16, which inductor cannot lower)
    from gguf import GGMLQuantizationType as Q

    from engine.compiled import compilable
    from engine.gguf_loader import GGUFModel
    from engine.quants.blocks import dequantize

    path = tmp_path / "q8.gguf"
    qwen3next_gguf(path, qwen3_next(shared=64), Q.Q8_0, legacy=layout == "ssm_in")  # all Q8_0, as a real file
    model = _cpu_default(path).model
    assert model.forms == {"quant": 16, "quant-experts": 4} and compilable(model)  # experts too: blocks
    split = ["0.lin_qkv", "0.lin_z"] if layout == "ssm_in" else []
    for name in [*split, "0.lin_b", "0.lin_a", "1.q", "1.q_gate"]:  # the same weights as the dense split
        blocks = GGUFModel(path).quant("layers." + name)
        assert torch.equal(dequantize(blocks), GGUFModel(path).dense("layers." + name))


def _cpu_default_packages(folder) -> list[str]:
    """The packages of the CPU default's model of a Q8_0 file, built early (tests/helpers/early.py)."""
    from gguf import GGMLQuantizationType as Q

    qwen3next_gguf(folder / "q8.gguf", qwen3_next(shared=64), Q.Q8_0)
    engine = _cpu_default(folder / "q8.gguf", num_slots=2)
    engine.compile_decode(warm=True)
    return packaged(engine)


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler: engine/quants' kernels cannot be built")
@pytest.mark.early.with_args(_cpu_default_packages)
def test_the_cpu_default_decodes_compiled_ahead_of_time_as_eagerly(packages, tmp_path):
    # the CPU default's step: every layer and the head in the packages compiled ahead of time (two:
    # one row, 2+ rows), the DeltaNet's state read and written inside them; eager's greedy tokens.
    # The packages were built in another process (`packages`), found here by their key.
    from gguf import GGMLQuantizationType as Q

    path = tmp_path / "q8.gguf"
    qwen3next_gguf(path, qwen3_next(shared=64), Q.Q8_0)
    eager, ahead = _cpu_default(path, num_slots=2), _cpu_default(path, num_slots=2)
    ahead.compile_decode(warm=True)
    assert ahead.compiled is not None and [p.batched for p in ahead.compiled.packaged] == [False, True]
    assert [p.path for p in ahead.compiled.packaged] == packages
    assert all(p.ready and p.head for p in ahead.compiled.packaged)

    def greedy(engine: TorchEngine) -> list[list[int]]:  # two slots together, then slot 1 alone
        out = {}
        for slot, length in ((0, 20), (1, 5)):
            engine.begin(slot, SamplingParams(temperature=0.0))
            out[slot] = [engine.read(slot, _prompt(length, slot), sample=True)]
        for group in [[0, 1]] * 10 + [[1]] * 10:
            for slot, new in zip(group, engine.decode(group, [out[s][-1] for s in group])):
                out[slot] += new
        return [out[0], out[1]]

    assert greedy(ahead) == greedy(eager)
    assert "_layer" not in vars(ahead.compiled)  # no per-layer graph: every step went through a package


def test_loaded_as_a_worker_loads_it_prompt_lookup_stays_off(tiny_model, tmp_path):
    # load_engine (a worker's loader) on an HF folder with SmolLM2's tokenizer: on the CPU with two
    # slots prompt lookup is on by default, but not for a model whose state cannot take a guess back
    import shutil

    from engine.load import load_engine

    hf = qwen3_next()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    for name in tiny_model.iterdir():
        if "token" in name.name or name.name.endswith((".jinja", ".txt")) and "vocab" not in name.name:
            shutil.copy(name, tmp_path / name.name)
    engine = load_engine(tmp_path, num_slots=2, ctx=256, dtype="float32", compile=False)
    assert not engine.rewinds and not engine.prompt_lookup
    prompt = _prompt(20, 8)
    engine.begin(1, SamplingParams(temperature=0.0))
    tokens = [engine.read(1, prompt, sample=True)]
    for _ in range(3):
        tokens += engine.decode([1], [tokens[-1]])[0]
    assert tokens == hf_greedy(hf, prompt, 4)


@pytest.mark.parametrize("seq", [1, 5, 64, 70, 130])
def test_chunked_delta_rule_matches_the_token_loop(seq):
    # batch 2, 8 heads (q, k as delta_step hands them on, repeated per value head), a nonzero
    # state as a parked read leaves it
    import torch.nn.functional as F
    from engine.deltanet import delta_rule_chunked, delta_rule_steps
    gen = torch.Generator().manual_seed(seq)
    bsz, heads, dk, dv = 2, 8, 16, 8
    q = F.normalize(torch.randn(bsz, seq, heads, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(bsz, seq, heads, dk, generator=gen), dim=-1)
    v = torch.randn(bsz, seq, heads, dv, generator=gen)
    beta = torch.rand(bsz, seq, heads, generator=gen)
    g = -F.softplus(torch.randn(bsz, seq, heads, generator=gen))
    s0 = torch.randn(bsz, heads, dk, dv, generator=gen)
    want_out, want_state = delta_rule_steps(q, k, v, beta, g, s0)
    out, state = delta_rule_chunked(q, k, v, beta, g, s0)
    assert (out - want_out).abs().max() <= 1e-5 * want_out.abs().max()
    assert (state - want_state).abs().max() <= 1e-5 * want_state.abs().max()
