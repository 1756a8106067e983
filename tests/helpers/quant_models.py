"""Random GGUF models in the mixes llama.cpp's quantize makes, written with gguf's own writer:
valid random blocks of any type engine/quants takes (gguf-py quantizes only some types), for
tests/engine/test_quants.py and bench/quant_speed.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from tests.helpers.gguf_write import copy_tokenizer

GGUF_QUANTIZES = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
# Byte offsets of each block's f16 scales (d, and dmin / m where the type has one): random bytes
# there would be NaN, inf or subnormal scales, so they get random normal halves instead.
F16_AT = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
          Q.Q6_K: [208], Q.IQ4_XS: [0], Q.IQ3_S: [0]}
# A scale giving weights of roughly 0.02-0.05 (d times the largest code of the type).
SCALE = {Q.Q8_0: 3e-4, Q.Q4_0: 5e-3, Q.Q4_1: 5e-3, Q.Q5_0: 2e-3, Q.Q5_1: 2e-3, Q.Q4_K: 1e-4, Q.Q5_K: 5e-5,
         Q.Q6_K: 5e-5, Q.IQ4_XS: 1e-5, Q.IQ3_S: 1e-4}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random bytes of a [rows, cols] matrix: every code random, scales random of either sign."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        halves = (rng.uniform(0.5, 1.5, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2]) * SCALE[qtype])
        raw[..., at:at + 2] = halves.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


DIM, HIDDEN, LAYERS, HEADS, KV, VOCAB = 256, 512, 2, 4, 2, 320


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose v and down llama.cpp's K-quant mixes keep in more bits: the first and
    last eighth and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mix(name: str, layers: int = LAYERS):
    """tensor name -> type, after llama.cpp's recipes (Q4_K_M: v and down of `more_bits` layers in
    Q6_K, the rest Q4_K; the output Q6_K; Q4_0: all Q4_0 but the output, Q6_K), on a model whose
    widths are multiples of 256."""
    def pick(tensor: str) -> Q:
        if tensor.endswith("norm.weight"):
            return Q.F32
        layer = int(tensor.split(".")[1]) if tensor.startswith("blk.") else -1
        sensitive = tensor.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and more_bits(layer, layers)
        if name == "Q4_K_M":
            return Q.Q6_K if tensor == "output.weight" or sensitive else Q.Q4_K
        if name == "Q4_K_M+Q8_0":  # Q4_K_M, k in Q8_0 and up in Q5_0: every kind of part in one model
            if tensor.endswith(("attn_k.weight", "ffn_up.weight")) and layer >= 0:
                return Q.Q8_0 if tensor.endswith("attn_k.weight") else Q.Q5_0
            return Q.Q6_K if tensor == "output.weight" or sensitive else Q.Q4_K
        if name == "Q5_K_M":
            return Q.Q6_K if tensor == "output.weight" or sensitive else Q.Q5_K
        if name == "Q4_0":
            return Q.Q6_K if tensor == "output.weight" else Q.Q4_0
        if name == "Q6_K":
            return Q.Q6_K
        if name == "Q8_0":
            return Q.Q8_0
        if name == "Q5_0":  # what a K-quant mix falls back to on widths that are not 256s (SmolLM2's 576)
            return Q.Q8_0 if tensor in ("token_embd.weight", "output.weight") else (Q.Q5_1 if sensitive else Q.Q5_0)
        if name == "IQ4_XS":
            return Q.Q6_K if tensor == "output.weight" else Q.IQ4_XS
        if name == "IQ3_S":
            return Q.Q6_K if tensor == "output.weight" else (Q.Q4_K if sensitive else Q.IQ3_S)
        raise ValueError(name)
    return pick


@dataclass(frozen=True)
class Shape:
    dim: int = DIM
    hidden: int = HIDDEN
    layers: int = LAYERS
    heads: int = HEADS
    kv: int = KV
    vocab: int = VOCAB


def shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    dim, vocab, hd = shape.dim, shape.vocab, shape.dim // shape.heads
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, dim), "output.weight": (vocab, dim),
                                       "output_norm.weight": (dim,)}
    for i in range(shape.layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": (dim,), p + "ffn_norm.weight": (dim,), p + "attn_q.weight": (dim, dim),
                p + "attn_k.weight": (shape.kv * hd, dim), p + "attn_v.weight": (shape.kv * hd, dim),
                p + "attn_output.weight": (dim, dim), p + "ffn_gate.weight": (shape.hidden, dim),
                p + "ffn_up.weight": (shape.hidden, dim), p + "ffn_down.weight": (dim, shape.hidden)}
    return out


def write_mix(path, name: str, shape: Shape = Shape(), quantize_small: bool = True, tokenizer_of=None) -> int:
    """A random model of that shape in that mix; returns the file's tensor bytes. Types gguf-py
    quantizes are quantized from random weights (`quantize_small`; else random blocks, as for
    the rest: quantizing a billion weights in numpy takes minutes). `tokenizer_of`: a GGUF whose
    tokenizer (every `tokenizer.` key) the file carries, so that a server can take text for it."""
    rng = np.random.default_rng(7)
    pick = mix(name, shape.layers)
    writer = GGUFWriter(path, "llama")
    if tokenizer_of is not None:
        copy_tokenizer(GGUFReader(tokenizer_of), writer)
    writer.add_block_count(shape.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.dim)
    writer.add_feed_forward_length(shape.hidden)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    for tensor, dims in shapes(shape).items():
        qtype = pick(tensor)
        if qtype == Q.F32:
            writer.add_tensor(tensor, (1 + 0.1 * rng.standard_normal(dims)).astype(np.float32))
        elif qtype in GGUF_QUANTIZES and quantize_small:
            writer.add_tensor(tensor, gguf_quantize(rng.normal(0, 0.05, dims).astype(np.float32), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor, random_blocks(qtype, *dims, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
