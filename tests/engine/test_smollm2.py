"""The real SmolLM2 file: tokenizer, logits against transformers, greedy batch-vs-solo identity."""

from __future__ import annotations

import pytest
import torch

from engine.protocol import SamplingParams
from tests.engine.conftest import prefill_logits

pytestmark = pytest.mark.smollm2

GREEDY = SamplingParams(temperature=0.0)
TARGET = [{"role": "user", "content": "Write a short poem about the sea."}]
OTHERS = [
    [{"role": "user", "content": "What is 17 times 23?"}],
    [{"role": "user", "content": "List three colours. " * 40}],  # long: moves the attention bucket
    [{"role": "user", "content": "Hi"}],
]
STEPS = 24


def test_chat_template_and_eos(smollm2):
    tok = smollm2.tokenizer
    text = tok._tok.decode(tok.encode_chat([{"role": "user", "content": "Hello"}]))
    assert text.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    im_end = tok._tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids
    assert tok.vocab_size == 49152


def test_decode_encode_round_trip(smollm2):
    tok = smollm2.tokenizer
    for text in ["Hello, world!", "  spaces\tand\nnewlines ", "naïve café — 東京 🙂", "def f(x):\n    return x**2"]:
        assert tok.decode(tok.encode(text)) == text


def test_logits_match_transformers_gguf_load(smollm2, new_smollm2_engine):
    # transformers' own GGUF reading (dequantize + its reverse Q/K permute) as the reference.
    # AutoModelForCausalLM.from_pretrained(gguf_file=...) would need `accelerate`, which is not
    # installed, so build the model from its config and load the tensors it parsed.
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2.path
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    hf.tie_weights()
    engine = new_smollm2_engine(torch.float32, num_slots=1, ctx=128)
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    ours = prefill_logits(engine.model, 0, ids)
    # Same dequantized weights in float32: only the order of operations differs.
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    assert int(ours.argmax()) == int(ref.argmax())


def _generate_solo(engine, ids: list[int], slot: int) -> list[int]:
    engine.begin(slot, GREEDY)
    out = [_read_chunked(engine, slot, ids)]
    for _ in range(STEPS - 1):
        out += engine.decode([slot], [out[-1]])[0]
    return out


def _read_chunked(engine, slot: int, ids: list[int], chunk: int = 32) -> int:
    first = None
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        first = engine.read(slot, piece, sample=start + chunk >= len(ids))
    return first


def _generate_in_batch(engine, ids: list[int], slot: int) -> list[int]:
    tok = engine.tokenizer
    others = [s for s in range(engine.num_slots) if s != slot]
    last = {}
    for other, messages in zip(others, OTHERS):
        engine.begin(other, SamplingParams(temperature=0.9, seed=other))
        last[other] = _read_chunked(engine, other, tok.encode_chat(messages))
    engine.begin(slot, GREEDY)
    last[slot] = _read_chunked(engine, slot, ids)
    out = [last[slot]]
    order = [others[0], slot, *others[1:]]  # scattered order: the gathered attention path
    for step in range(STEPS - 1):
        active = order if step % 2 else sorted(order)  # and every other step the sliced path
        for s, new in zip(active, engine.decode(active, [last[s] for s in active])):
            [last[s]] = new
        out.append(last[slot])
    return out


def test_greedy_is_identical_alone_and_beside_others(smollm2_f32):
    # float32: bf16 products may depend on the batch's shape in oneDNN; the default's int4 kernel
    # is row by row and has its own batch-vs-solo test (test_int4.py).
    engine = smollm2_f32
    ids = engine.tokenizer.encode_chat(TARGET)
    solo = _generate_solo(engine, ids, slot=2)
    batched = _generate_in_batch(engine, ids, slot=2)
    assert batched == solo, engine.tokenizer.decode(solo) + " || " + engine.tokenizer.decode(batched)


def test_seeded_sampling_is_reproducible(smollm2_f32):
    engine = smollm2_f32
    ids = engine.tokenizer.encode("Once upon a time")
    runs = []
    for _ in range(2):
        engine.begin(0, SamplingParams(temperature=1.0, top_p=0.95, seed=42))
        out = [engine.read(0, ids, sample=True)]
        for _ in range(8):
            out += engine.decode([0], [out[-1]])[0]
        runs.append(out)
    assert runs[0] == runs[1]


def test_read_past_ctx_is_rejected_and_truncate_rewinds(new_smollm2_engine):
    engine = new_smollm2_engine(torch.float32, num_slots=2, ctx=16)
    engine.begin(1, GREEDY)
    engine.read(1, list(range(100, 110)), sample=False)
    with pytest.raises(ValueError, match="exceed ctx"):
        engine.read(1, list(range(7)), sample=False)
    assert engine.position(1) == 10
    first = engine.read(1, [5, 6], sample=True)
    engine.truncate(1, 10)
    assert engine.position(1) == 10 and engine.read(1, [5, 6], sample=True) == first
    with pytest.raises(ValueError):
        engine.truncate(1, 13)
