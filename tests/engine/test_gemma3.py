"""Gemma 3 (text) against transformers: sliding-window layers between global ones with their own
RoPE base, (1 + weight) norms before and after attention and FFN, scaled embeddings, the query
pre-attention scalar, the logits' soft-cap; from an HF folder, a float32 GGUF and a Q8_0 GGUF."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import hf_loader
from engine.compiled import compilable
from engine.gguf_loader import GGUFModel
from engine.model import Transformer
from engine.weights import DictSource
from tests.helpers.family_gguf import gemma3_gguf
from tests.helpers.hf_reference import check_engine_greedy, check_prefill_and_decode

WINDOW = 12  # shorter than the test's prompts (9-70 tokens), so the sliding layers' mask matters


def gemma3(softcap: bool = False, scaled_rope: bool = False):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    full = {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0} if scaled_rope else {"rope_type": "default", "rope_theta": 100000.0}
    cfg = Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        query_pre_attn_scalar=24, rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=5.0 if softcap else None,
        tie_word_embeddings=True, attn_implementation="eager",
    )
    hf = Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # Gemma's norms start at zero (a scale of one): make them count
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return hf.float().eval()


VARIANTS = {"plain": {}, "softcap": {"softcap": True}, "linear-rope": {"scaled_rope": True}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_folder_matches_transformers(variant, tmp_path):
    hf = gemma3(**VARIANTS[variant])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = hf_loader.read_config(tmp_path)
    assert cfg.sliding_layers == (True, False, True, True) and cfg.sliding_window == WINDOW
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 100000.0
    model = Transformer.build(cfg, DictSource(hf_loader.load_weights(tmp_path)), dtype=torch.float32, device=torch.device("cpu"))
    assert compilable(model)  # the compiled steps take the sliding layers' inputs too
    model.allocate_cache(num_slots=4, ctx=256)
    check_prefill_and_decode(hf, model)
    check_engine_greedy(hf, model)


def test_the_window_and_the_local_base_matter(tmp_path):
    # The same weights read as if every layer were global with one RoPE base must differ from
    # transformers' logits: the test above would catch a loader that dropped either.
    hf = gemma3()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = hf_loader.read_config(tmp_path)
    weights = hf_loader.load_weights(tmp_path)
    from dataclasses import replace

    from tests.helpers.hf_reference import hf_logits
    from tests.engine.conftest import prefill_logits

    ids = list(range(40))
    ref = hf_logits(hf, ids)[-1]
    for wrong in (replace(cfg, sliding_window=0), replace(cfg, rope_local_theta=0.0)):
        model = Transformer.build(wrong, DictSource(weights), dtype=torch.float32, device=torch.device("cpu"))
        model.allocate_cache(num_slots=1, ctx=64)
        assert float((prefill_logits(model, 0, ids) - ref).abs().max()) > 1e-2


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("variant", ["plain", "softcap"])
def test_gguf_matches_transformers(variant, qtype, tmp_path):
    hf = gemma3(**VARIANTS[variant])
    path = tmp_path / "gemma3.gguf"
    held = gemma3_gguf(path, hf, qtype)
    loaded = GGUFModel(path)
    assert loaded.config.sliding_layers == (True, False, True, True) and loaded.config.tie_embeddings
    if qtype == Q.Q8_0:
        stored = {t.name: t.qtype for t in loaded.file.tensors.values()}
        assert stored["blk.0.attn_q.weight"] == Q.Q8_0 and stored["token_embd.weight"] == Q.Q8_0
        result = hf.load_state_dict(held, strict=False)  # the file's own weights (lm_head is tied to them)
        assert not result.unexpected_keys and result.missing_keys == ["lm_head.weight"]
    model = Transformer.build(loaded.config, loaded, dtype=torch.float32, device=torch.device("cpu"))
    model.allocate_cache(num_slots=4, ctx=256)
    check_prefill_and_decode(hf, model)
