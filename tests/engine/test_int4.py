"""int4 decode weights (load_engine(int4_decode=True)): built from the GGUF's Q4_0/Q4_1 blocks,
used by decode steps of <= INT4_MAX_ROWS rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.gguf_loader import GGUFModel
from engine.model import INT4_MAX_ROWS, Int4Blocks, Int4Linear, Transformer
from engine.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]
STEPS = 16


def dequantize_blocks(blocks: Int4Blocks) -> torch.Tensor:
    q, scale, offset = blocks
    group = q.shape[1] // scale.shape[1]
    return q.float() * scale.repeat_interleave(group, 1) + offset.repeat_interleave(group, 1)


def kernel_weight(blocks: Int4Blocks) -> torch.Tensor:
    """The weight the int4 op really uses: (q - 8) * s + z with s, z rounded to bf16."""
    q, scale, offset = blocks
    group = q.shape[1] // scale.shape[1]
    s = scale.bfloat16().float()
    z = (offset + 8 * scale).bfloat16().float()
    return (q.float() - 8) * s.repeat_interleave(group, 1) + z.repeat_interleave(group, 1)


def test_q4_0_file_blocks_are_the_dequantized_weights(tmp_path):
    # A tiny llama-arch file, every matrix Q4_0: the blocks (un-permuted like weights()) dequantize
    # to exactly what the loader gives, and the int4 decode path runs close to the dense one.
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.engine.test_gguf_loader import gguf_tensors, write_gguf

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False,
    )).float().eval()
    path = tmp_path / "tiny-q4_0.gguf"
    write_gguf(path, gguf_tensors(hf), lambda name, w: Q.Q4_0 if w.ndim == 2 else Q.F32)
    loaded = GGUFModel(path)
    weights, blocks = loaded.weights(), loaded.int4_blocks()
    assert blocks is not None and len(blocks) == 2 * 7
    for name, b in blocks.items():
        assert torch.equal(dequantize_blocks(b), weights[name]), name

    model = Transformer.from_weights(loaded.config, weights, dtype=torch.float32, device=torch.device("cpu"))
    model.allocate_cache(2, 64)
    ids = torch.tensor(list(range(3, 20)))
    with torch.inference_mode():
        model.prefill(0, ids, 0)
        model.prefill(1, ids, 0)
        args = (torch.tensor([0, 1]), torch.tensor([7, 9]), torch.tensor([17, 17]), 64, (0, 2))
        dense = model.decode(*args)
        assert model.attach_int4(blocks)
        int4 = model.decode(*args)
    torch.testing.assert_close(int4, dense, atol=2e-2, rtol=0)


def test_f16_file_has_no_int4_blocks(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.engine.test_gguf_loader import gguf_tensors, write_gguf

    hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    path = tmp_path / "tiny-f16.gguf"
    write_gguf(path, gguf_tensors(hf), lambda name, w: Q.F16 if w.ndim == 2 else Q.F32)
    assert GGUFModel(path).int4_blocks() is None


@pytest.mark.smollm2
def test_int4_linear_matches_dequantized_f32(smollm2):
    # The blocks are exactly the file's weights (Q/K rows un-permuted like weights()).
    for name in ("layers.0.q", "layers.0.k", "layers.0.v", "layers.7.o", "layers.29.gate", "layers.29.down"):
        assert torch.equal(dequantize_blocks(smollm2.int4_blocks[name]), smollm2.weights[name]), name
    torch.manual_seed(0)
    for name in ("layers.0.q", "layers.29.down"):
        blocks, weight = smollm2.int4_blocks[name], smollm2.weights[name]
        lin = Int4Linear(blocks)
        for rows in (1, 4, INT4_MAX_ROWS):
            x = torch.randn(rows, weight.shape[1])
            y = lin(x)
            # Against float32 F.linear of the weights the op uses, on the bf16-rounded input: only
            # accumulation order and the bf16 rounding of the output (<= 2^-9 relative) differ.
            ref = F.linear(x.bfloat16().float(), kernel_weight(blocks))
            torch.testing.assert_close(y, ref, atol=1e-3, rtol=2**-8)
            # Against the file's exact weights in float32: bf16 input/scale/output rounding, about
            # what a dense bf16 F.linear costs (0.3 % of the output's norm here).
            exact = F.linear(x, weight)
            rel = float((y - exact).norm() / exact.norm())
            dense_bf16 = float((F.linear(x.bfloat16(), weight.bfloat16()).float() - exact).norm() / exact.norm())
            assert rel < 6e-3 and rel < 1.5 * dense_bf16, (name, rows, rel, dense_bf16)


def _decode_logits(engine, prompt_ids, tokens):
    """Prefill slot 0, then feed `tokens` one at a time: logits of each decode step [S, V]."""
    engine.begin(0, GREEDY)
    engine.read(0, prompt_ids, sample=False)
    out = []
    with torch.inference_mode():
        for i, t in enumerate(tokens):
            pos = len(prompt_ids) + i
            out.append(engine.model.decode(torch.tensor([0]), torch.tensor([t]), torch.tensor([pos]), 256, (0, 1))[0])
            engine._positions[0] = pos + 1
    return torch.stack(out)


def _greedy(engine, slot, prompt_ids, steps):
    engine.begin(slot, GREEDY)
    out = [engine.read(slot, prompt_ids, sample=True)]
    while len(out) < steps:
        out.append(engine.decode([slot], [out[-1]])[0])
    return out


@pytest.fixture(scope="module")
def engines(smollm2, new_smollm2_engine):
    return {
        "dense": new_smollm2_engine(torch.float32, num_slots=3, ctx=256),
        "int4": new_smollm2_engine(torch.float32, num_slots=3, ctx=256, int4=True),
    }


@pytest.mark.smollm2
def test_int4_decode_logits_and_greedy_match_dense(smollm2, engines):
    tok = smollm2.tokenizer
    dense, int4 = engines["dense"], engines["int4"]
    assert int4.model.layers[0].int4 is not None and dense.model.layers[0].int4 is None
    for messages in PROMPTS:
        ids = tok.encode_chat(messages)
        want = _greedy(dense, 0, ids, STEPS)
        got = _greedy(int4, 0, ids, STEPS)
        print(tok.decode(want), "|", tok.decode(got))
        assert got == want
        # Teacher-forced on the dense continuation: every decode step's logits.
        a = _decode_logits(dense, ids, want)
        b = _decode_logits(int4, ids, want)
        diff = (a - b).abs().max(dim=-1).values
        print("max |logit diff| per step", [round(float(d), 3) for d in diff])
        assert float(diff.max()) < 0.75  # seen: 0.12-0.47 (dense bf16 linears are of the same order)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.smollm2
def test_int4_batch_of_three_equals_solo(smollm2, engines):
    tok = smollm2.tokenizer
    engine = engines["int4"]
    prompts = [tok.encode_chat(m) for m in PROMPTS + [[{"role": "user", "content": "Name three rivers."}]]]
    solo = [_greedy(engine, 0, ids, STEPS) for ids in prompts]
    last = []
    for slot, ids in enumerate(prompts):
        engine.begin(slot, GREEDY)
        last.append(engine.read(slot, ids, sample=True))
    batch = [[t] for t in last]
    while len(batch[0]) < STEPS:
        for slot, t in enumerate(engine.decode([0, 1, 2], [b[-1] for b in batch])):
            batch[slot].append(t)
    assert batch == solo
