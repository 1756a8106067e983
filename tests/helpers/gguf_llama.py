"""A tiny random llama written as a GGUF by hand, one quantization type per tensor (the loader's
tests mix types tensor by tensor; tests/helpers/gguf_write.py writes whole transformers models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from engine.gguf_loader import GGUFModel
from tests.helpers.gguf_write import permute_qk

N_HEADS, N_KV = 4, 2
GGUF_NAMES = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_tensors(hf) -> dict[str, np.ndarray]:
    out = {}
    for name, p in hf.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            out["output.weight"] = w
        else:
            parts = name.split(".")  # model.layers.{i}[.self_attn|.mlp].{proj}.weight
            i, proj = parts[2], parts[-2]
            if proj == "q_proj":
                w = permute_qk(w, N_HEADS)
            elif proj == "k_proj":
                w = permute_qk(w, N_KV)
            out[f"blk.{i}.{GGUF_NAMES[proj]}.weight"] = w
    return out


def write_gguf(path, tensors: dict[str, np.ndarray], qtype_of, extra=None) -> None:
    writer = GGUFWriter(path, "llama")
    if extra is not None:
        extra(writer)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(256)
    for name, w in tensors.items():
        qtype = qtype_of(name, w)
        if qtype == Q.F32:
            writer.add_tensor(name, w)
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama_file(tmp_path: Path, qtype: Q) -> GGUFModel:
    """A tiny random llama as a GGUF, every matrix in `qtype` (norms float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False,
    )).float().eval()
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, gguf_tensors(hf), lambda name, w: qtype if w.ndim == 2 else Q.F32)
    return GGUFModel(path)
