"""RoPE scaling (engine/rope.py) against transformers' own rotary modules, and from both loaders."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from engine import hf_loader, rope
from engine.gguf_loader import GGUFModel
from engine.model import Transformer
from engine.weights import DictSource
from tests.helpers.hf_reference import check_prefill_and_decode

HEAD_DIM = 16
# A short "original" context so the positions of a test (up to ~70) are where the scalings differ.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
                   "beta_slow": 2.0, "attention_factor": 1.3},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}


def _llama_config(scaling: dict | None, max_positions: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})}, tie_word_embeddings=False,
    )


def _hf_tables(config, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, positions, HEAD_DIM)
    cos, sin = module(x, torch.arange(positions).unsqueeze(0))
    return cos[0], sin[0]


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_tables_match_transformers_rotary_module(kind):
    config = _llama_config(SCALINGS[kind])
    theta, scaling = rope.from_hf(config.to_dict())
    assert scaling.kind == SCALINGS[kind]["rope_type"]
    positions = 200  # past max_position_embeddings (64): dynamic's base grows, as transformers' does
    cos, sin = rope.tables(HEAD_DIM, theta, scaling, positions)
    ref_cos, ref_sin = _hf_tables(config, positions)
    # transformers computes the angles in float32 (ours in float64): ~1e-5 apart at position 200
    torch.testing.assert_close(cos, ref_cos, atol=5e-5, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=5e-5, rtol=0)
    plain_cos, _ = rope.tables(HEAD_DIM, theta, rope.RopeScaling(), positions)
    assert float((cos - plain_cos).abs().max()) > 0.1, "the scaling changed nothing at these positions"


def test_dynamic_within_its_context_is_plain():
    # transformers uses the plain frequencies for every sequence within max_position_embeddings;
    # so does an engine whose context is that long or shorter.
    theta, scaling = rope.from_hf(_llama_config(SCALINGS["dynamic"], max_positions=512).to_dict())
    cos, sin = rope.tables(HEAD_DIM, theta, scaling, 300)
    plain = rope.tables(HEAD_DIM, theta, rope.RopeScaling(), 300)
    torch.testing.assert_close((cos, sin), plain, atol=0, rtol=0)


@pytest.mark.parametrize("params, words", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 32}, "'longrope' is not supported"),
    ({"rope_type": "su", "factor": 2.0}, "'su' is not supported"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
      "mscale_all_dim": 1.0}, "mscale"),
])
def test_an_unimplemented_scaling_is_refused_at_load(tmp_path, params, words):
    raw = _llama_config(None).to_dict()
    raw.pop("rope_parameters")
    raw.update(model_type="llama", rope_theta=10000.0, rope_scaling=params)  # the transformers 4 spelling
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(rope.UnsupportedRope, match=words):
        hf_loader.read_config(tmp_path)


def test_transformers4_rope_scaling_is_read(tmp_path):
    raw = _llama_config(None).to_dict()
    raw.pop("rope_parameters")
    raw.update(model_type="llama", rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = hf_loader.read_config(tmp_path)
    assert cfg.rope_theta == 500000.0
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("linear", 2.0)


# ---- whole models against transformers, from an HF folder and from a GGUF --------------------


@pytest.fixture(scope="module", params=["llama3", "yarn", "linear"])
def scaled(request, tmp_path_factory):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(_llama_config(SCALINGS[request.param])).float().eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    return request.param, hf, folder


def test_hf_folder_with_scaling_matches_transformers(scaled):
    kind, hf, folder = scaled
    cfg = hf_loader.read_config(folder)
    assert cfg.rope_scaling.kind == kind
    model = Transformer.build(cfg, DictSource(hf_loader.load_weights(folder)), dtype=torch.float32, device=torch.device("cpu"))
    model.allocate_cache(num_slots=4, ctx=256)
    check_prefill_and_decode(hf, model)


def _permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(path, hf, scaling: dict) -> None:
    """The HF model as llama.cpp's converter writes it: Q/K rows permuted, its rope scaling keys,
    and for llama3 the `rope_freqs` tensor of per-frequency divisors instead of any key."""
    import gguf

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(256)
    kind = scaling["rope_type"]
    if kind == "llama3":  # llama.cpp: rope_freqs = plain / scaled inverse frequency, per frequency
        plain, _ = rope.inv_freq(HEAD_DIM, 10000.0, rope.RopeScaling(), 64)
        scaled, _ = rope.inv_freq(HEAD_DIM, 10000.0, rope.from_hf(hf.config.to_dict())[1], 64)
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", (plain / scaled).float().numpy())
    else:
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(scaling["factor"])
        if kind == "yarn":
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    for name, p in hf.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", w)
        else:
            parts = name.split(".")
            proj = parts[-2]
            if proj in ("q_proj", "k_proj"):
                w = _permute(w, 4 if proj == "q_proj" else 2)
            writer.add_tensor(f"blk.{parts[2]}.{names[proj]}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_with_scaling_matches_transformers(scaled, tmp_path):
    kind, hf, _ = scaled
    path = tmp_path / f"{kind}.gguf"
    write_llama_gguf(path, hf, SCALINGS[kind])
    loaded = GGUFModel(path)
    assert (loaded.config.rope_scaling.freq_factors is not None) == (kind == "llama3")
    model = Transformer.build(loaded.config, loaded, dtype=torch.float32, device=torch.device("cpu"))
    model.allocate_cache(num_slots=4, ctx=256)
    check_prefill_and_decode(hf, model)


def test_gguf_longrope_is_refused(tmp_path):
    import gguf

    path = tmp_path / "longrope.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(rope.UnsupportedRope, match="'longrope' is not supported"):
        GGUFModel(path)
