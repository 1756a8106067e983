"""Write a transformers model as a GGUF the way llama.cpp's converter lays it out, for the tests.

Names come from gguf's own map (`gguf.get_tensor_name_map`: HF name -> llama.cpp's); one MoE
layer's experts are stacked into one [E, ...] tensor per projection, as the converter does; Q/K
rows permuted for `llama`; Gemma's norms stored as 1 + weight. Matrices can be quantized (Q8_0
here): the function returns the weights the file holds, dequantized, under the HF names, so a
transformers model loaded with them is the exact reference for the quantized file.
"""

from __future__ import annotations

import re
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def permute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter on `llama` Q/K rows: within a head, row i and i + hd/2 become neighbours."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_hf_as_gguf(path, hf, arch: gguf.MODEL_ARCH, metadata: Callable[[GGUFWriter], None], *,
                     qtype: Q = Q.F32, heads: tuple[int, int] | None = None,
                     norm_plus_one: bool = False, tokenizer_of=None,
                     pick: Callable[[str], Q] | None = None) -> dict[str, torch.Tensor]:
    """heads: (n_heads, n_kv_heads) to permute Q/K rows (`llama`); norm_plus_one: Gemma's norms;
    tokenizer_of: a GGUF whose tokenizer the file carries (so that a server can take text);
    pick: llama.cpp's tensor name -> its type (a mix, tests/helpers/quant_models.py `mix`), instead
    of `qtype` for every matrix; a type gguf-py cannot quantize (K-quants, IQ) gets valid random
    blocks instead of the model's weights (the returned weights are then those blocks').
    Returns {hf name: float32 tensor as stored in the file, dequantized, HF layout}."""
    from tests.helpers.quant_models import GGUF_QUANTIZES, random_blocks  # it imports this module

    rng = np.random.default_rng(11)
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    if getattr(hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    grouped: dict[str, dict[int, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}
    for name, w in state.items():
        match = _EXPERT.match(name)
        if match:
            grouped.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = w
        elif name.endswith("experts.gate_up_proj"):  # transformers 5 holds experts fused: [E, 2I, dim]
            gate, up = np.split(w, 2, axis=1)
            tensors[name.replace("gate_up_proj", "gate_proj")], tensors[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            tensors[name.removesuffix(".weight")] = w
    for base, by_index in grouped.items():
        tensors[base] = np.stack([by_index[j] for j in range(len(by_index))])

    names = gguf.get_tensor_name_map(arch, hf.config.num_hidden_layers)
    writer = GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    metadata(writer)
    if tokenizer_of is not None:
        copy_tokenizer(gguf.GGUFReader(tokenizer_of), writer)
    stored: dict[str, np.ndarray] = {}
    for base, w in tensors.items():
        target = names.get_name(base)
        assert target is not None, f"no llama.cpp name for {base}"
        if norm_plus_one and base.endswith("norm"):
            w = w + 1
        kind = pick(target + ".weight") if pick is not None else qtype
        quantized = kind != Q.F32 and w.ndim >= 2 and w.shape[-1] % 32 == 0 and not base.endswith(".gate")
        if quantized:  # the router (ffn_gate_inp) stays float32, as llama-quantize leaves it
            if kind in GGUF_QUANTIZES:
                raw = quantize(w, kind)
            else:
                raw = random_blocks(kind, w.size // w.shape[-1], w.shape[-1], rng).reshape(*w.shape[:-1], -1)
            held = dequantize(raw, kind).reshape(w.shape)
        else:
            raw, held = w, w
        if heads is not None and base.endswith(("q_proj", "k_proj")):
            n = heads[0] if base.endswith("q_proj") else heads[1]
            raw = permute_qk(raw, n)  # rows permuted whole, so the same blocks as quantizing after
        writer.add_tensor(target + ".weight", raw, raw_dtype=kind if quantized else None)
        stored[base] = held - 1 if norm_plus_one and base.endswith("norm") else held
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out: dict[str, torch.Tensor] = {}
    for base, w in stored.items():
        if base in grouped:
            for j in range(w.shape[0]):
                out[f"{base.rsplit('.', 1)[0]}.{j}.{base.rsplit('.', 1)[1]}.weight"] = torch.from_numpy(w[j].copy())
        elif base.endswith("experts.gate_proj"):
            up = stored[base.replace("gate_proj", "up_proj")]
            out[base.replace("gate_proj", "gate_up_proj")] = torch.from_numpy(np.concatenate([w, up], axis=1))
        elif base.endswith("experts.up_proj"):
            continue
        elif base.endswith("experts.down_proj"):
            out[base] = torch.from_numpy(np.ascontiguousarray(w))
        else:
            out[base + ".weight"] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def copy_tokenizer(source: gguf.GGUFReader, writer: GGUFWriter) -> None:
    """Every `tokenizer.` key of another file (vocabulary, merges, special ids, chat template)."""
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[1] if len(field.types) > 1 else None)


def common_metadata(writer: GGUFWriter, cfg, *, expert_ffn: int | None = None) -> None:
    """The keys every architecture here reads, from a transformers config."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    params = cfg.rope_parameters
    writer.add_rope_freq_base(float(params.get("rope_theta") or params["full_attention"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if expert_ffn is not None:
        writer.add_expert_feed_forward_length(expert_ffn)
