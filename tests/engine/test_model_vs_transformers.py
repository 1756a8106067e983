"""Our decoder against transformers on the same random weights, in float32."""

from __future__ import annotations

import pytest
import torch

from engine import hf_loader
from engine.model import Transformer
from engine.weights import DictSource
from tests.engine.conftest import decode_logits, prefill_logits

ATOL = 2e-4  # float32; observed differences are ~1e-5 (different op order only)

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
)


def _make_hf(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**TINY, rope_theta=50000.0, tie_word_embeddings=False))
    if kind == "llama-tied":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    if kind == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False))
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True))
    raise AssertionError(kind)


@pytest.fixture(params=["llama", "llama-tied", "qwen2", "qwen3"])
def pair(request, tmp_path):
    hf = _make_hf(request.param).float().eval()
    with torch.no_grad():  # random init leaves biases at zero; make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = hf_loader.read_config(tmp_path)
    ours = Transformer.build(cfg, DictSource(hf_loader.load_weights(tmp_path)), dtype=torch.float32, device=torch.device("cpu"))
    ours.allocate_cache(num_slots=4, ctx=256)
    return hf, ours


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


def test_chunked_prefill_matches(pair):
    hf, ours = pair
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _hf_logits(hf, ids)
    start = 0
    for chunk in (16, 1, 33, 20):  # uneven chunks, one of a single token
        logits = prefill_logits(ours, 2, ids[start : start + chunk], start)
        start += chunk
        torch.testing.assert_close(logits, ref[start - 1], atol=ATOL, rtol=0)


def test_batched_decode_in_scattered_slots_matches(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(2)
    prompts = {3: torch.randint(0, 256, (40,), generator=gen).tolist(), 1: torch.randint(0, 256, (9,), generator=gen).tolist()}
    extra = {3: torch.randint(0, 256, (5,), generator=gen).tolist(), 1: torch.randint(0, 256, (5,), generator=gen).tolist()}
    refs = {s: _hf_logits(hf, prompts[s] + extra[s]) for s in prompts}
    for slot, ids in prompts.items():
        prefill_logits(ours, slot, ids)
    slots = [3, 1]  # not in order, not contiguous: the gathered path
    for step in range(5):
        positions = [len(prompts[s]) + step for s in slots]
        logits = decode_logits(ours, slots, [extra[s][step] for s in slots], positions)
        for row, slot in enumerate(slots):
            torch.testing.assert_close(logits[row], refs[slot][positions[row]], atol=ATOL, rtol=0)


def test_contiguous_slots_take_the_sliced_path(pair):
    hf, ours = pair
    prompts = {0: list(range(10, 30)), 1: list(range(50, 53))}
    refs = {s: _hf_logits(hf, prompts[s] + [7]) for s in prompts}
    for slot, ids in prompts.items():
        prefill_logits(ours, slot, ids)
    positions = [20, 3]
    logits = decode_logits(ours, [0, 1], [7, 7], positions)
    for row, slot in enumerate((0, 1)):
        torch.testing.assert_close(logits[row], refs[slot][positions[row]], atol=ATOL, rtol=0)
