"""engine/quants: GGUF blocks kept as they are (Q8_0, Q5_0/Q5_1, K-quants, IQ4_XS, IQ3_S).

Unpacking equals gguf's own dequantize bit for bit (random valid blocks; gguf's quantize where
gguf-py has one); the product is within float32 rounding of float32 on the dequantized weights
(decode) or within bf16 rounding (prefill slabs); tiny models written by gguf's writer in the mixes
people download hold at most 1.15x the file's tensor bytes and give the dequantized-bf16 model's
greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine.gguf_loader import GGUFModel
from engine.model import Transformer
from engine.quants import blocks as quants
from engine.weights import DictSource, dequantize_int4, int4_available
from tests.engine.conftest import decode_logits, prefill_logits

pytestmark = pytest.mark.skipif(not quants.available(), reason="engine/quants kernels not built (no C++ compiler)")

NEW_TYPES = [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_S]
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


@pytest.mark.parametrize("qtype", sorted(quants.TYPES), ids=lambda q: q.name)
def test_unpacking_equals_gguf_dequantize_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    samples = [random_blocks(qtype, 9, 3 * block, rng)]
    raw = samples[0].copy()  # every byte random, scales included (NaN, inf, subnormal halves too)
    samples.append(rng.integers(0, 256, raw.shape, dtype=np.uint8))
    if qtype in GGUF_QUANTIZES:
        samples.append(gguf_quantize(rng.normal(0, 0.05, (9, 3 * block)).astype(np.float32), qtype))
    for raw in samples:
        with np.errstate(all="ignore"):  # NaN and inf scales in the all-random bytes
            expected = gguf_dequantize(raw, qtype)
        got = quants.dequantize(quants.QuantBlocks(torch.from_numpy(raw.copy()), qtype, 3 * block)).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=qtype.name)


def test_q4_k_repacked_as_int4_groups_is_gguf_dequantize_bit_for_bit():
    rng = np.random.default_rng(3)
    for raw in (random_blocks(Q.Q4_K, 6, 512, rng), rng.integers(0, 256, (6, 2 * 144), dtype=np.uint8)):
        with np.errstate(all="ignore"):
            expected = gguf_dequantize(raw, Q.Q4_K)
        got = dequantize_int4(quants.unpack_q4_k(quants.QuantBlocks(torch.from_numpy(raw.copy()), Q.Q4_K, 512))).numpy()
        nan = np.isnan(expected)  # a NaN scale's payload and sign are not a value
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.skipif(not int4_available(), reason="torch's CPU int4 kernel is missing")
def test_q4_k_on_torchs_int4_kernel_is_within_bf16_of_float32():
    """int4: bf16 activations and each group's scale and offset in bf16 (as Q4_0/Q4_1 files):
    relative error of the output <= 1e-2 (~3e-3 measured), decode and prefill alike."""
    rng = np.random.default_rng(4)
    raw = random_blocks(Q.Q4_K, 48, 512, rng)
    exact = torch.from_numpy(gguf_dequantize(raw, Q.Q4_K)).double()
    linear = quants.QuantLinear([quants.QuantBlocks(torch.from_numpy(raw), Q.Q4_K, 512)], int4=True)
    assert len(linear.int4) == 1 and quants.held_bytes(linear) <= 1.12 * raw.nbytes
    for tokens in (1, 20):
        x = torch.randn(2, tokens, 512)
        reference = x.double() @ exact.T
        assert float((linear(x).double() - reference).norm() / reference.norm()) <= 1e-2


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_product_is_float32_on_the_dequantized_weights(qtype):
    """Decode (few tokens a row): float32 products of the exact weights, relative error of the
    output <= 1e-5 (float32 accumulation over 512 terms: ~1e-7 measured). A prefill chunk (16+
    tokens a row): weights and activations rounded to bf16, <= 1e-2 (~3e-3 measured)."""
    rng = np.random.default_rng(1)
    rows, cols = 40, 512
    raw = random_blocks(qtype, rows, cols, rng)
    exact = torch.from_numpy(gguf_dequantize(raw, qtype)).double()
    blocks = quants.QuantBlocks(torch.from_numpy(raw), qtype, cols)
    linear = quants.QuantLinear([blocks, blocks], bias=torch.arange(2 * rows, dtype=torch.float32))
    torch.manual_seed(0)
    for tokens, tolerance in ((1, 1e-5), (3, 1e-5), (20, 1e-2)):
        x = torch.randn(2, tokens, cols)
        y = linear(x)
        assert y.shape == (2, tokens, 2 * rows) and y.dtype == torch.float32
        reference = x.double() @ torch.cat([exact, exact]).T + torch.arange(2 * rows).double()
        error = float((y.double() - reference).norm() / reference.norm())
        assert error <= tolerance, (qtype.name, tokens, error)


def test_a_row_of_a_batch_does_not_depend_on_its_neighbours():
    rng = np.random.default_rng(2)
    blocks = quants.QuantBlocks(torch.from_numpy(random_blocks(Q.Q4_K, 64, 256, rng)), Q.Q4_K, 256)
    linear = quants.QuantLinear([blocks])
    x = torch.randn(5, 1, 256)
    together = linear(x)
    for i in range(5):
        assert torch.equal(linear(x[i:i + 1]), together[i:i + 1])


# ---- tiny models in the mixes llama.cpp's quantize makes --------------------------------------

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
        sensitive = tensor.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits(layer, layers)
        if name == "Q4_K_M":
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


def write_mix(path, name: str, shape: Shape = Shape(), quantize_small: bool = True) -> int:
    """A random model of that shape in that mix; returns the file's tensor bytes. Types gguf-py
    quantizes are quantized from random weights (`quantize_small`; else random blocks, as for
    the rest: quantizing a billion weights in numpy takes minutes)."""
    rng = np.random.default_rng(7)
    pick = mix(name, shape.layers)
    writer = GGUFWriter(path, "llama")
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


MIXES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q5_0", "IQ4_XS", "IQ3_S"]


def greedy(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    model.allocate_cache(1, 128)
    tokens = [int(prefill_logits(model, 0, prompt).argmax())]
    for i in range(steps - 1):
        tokens.append(int(decode_logits(model, [0], [tokens[-1]], [len(prompt) + i], span=128)[0].argmax()))
    return tokens


@pytest.mark.parametrize("name", MIXES)
def test_a_mix_loads_in_its_file_size_and_decodes_as_the_dequantized_model(tmp_path, name):
    """Weight memory (the bytes of every tensor the model holds, KV cache aside) <= 1.15x the
    file's tensor bytes; greedy tokens equal the dequantized model's in bf16 (oneDNN-prepacked
    bf16 linears, the path these types took before) for at least 14 of 16 steps, teacher-forced
    on the float32 model's own tokens, and the logits within 5% of their range."""
    path = tmp_path / f"tiny-{name}.gguf"
    file_bytes = write_mix(path, name)
    loaded = GGUFModel(path)
    cpu = torch.device("cpu")
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=cpu, int4=True)
    linears = sum(model.forms.values())
    assert model.forms.get("quant", 0) == linears, model.forms  # every linear kept as the file's blocks
    held = quants.held_bytes(model)
    assert held <= 1.15 * file_bytes, (name, held / file_bytes)
    weights = loaded.weights()
    dense = Transformer.build(loaded.config, DictSource(weights), dtype=torch.bfloat16, device=cpu)
    exact = Transformer.build(loaded.config, DictSource(weights), dtype=torch.float32, device=cpu)
    assert "quant" not in dense.forms
    prompt = [5, 17, 33, 101, 7, 250, 64, 3]
    reference = greedy(exact, prompt, 16)
    for m in (model, dense):
        m.allocate_cache(1, 128)
    ids = prompt + reference
    ours = prefill_logits(model, 0, ids)
    theirs = prefill_logits(dense, 0, ids)
    span = float(theirs.max() - theirs.min())
    assert float((ours - theirs).abs().max()) <= 0.05 * span, name
    agree = 0
    for step in range(16):  # teacher-forced: each position's next token after the float32 model's text
        prefix = prompt + reference[:step]
        agree += int(prefill_logits(model, 0, prefix).argmax()) == int(prefill_logits(dense, 0, prefix).argmax())
    assert agree >= 14, (name, agree)
    if name == "Q4_K_M":  # and decode steps through mm (one token a row), not only prefill
        assert greedy(model, prompt, 8)[:4] == greedy(dense, prompt, 8)[:4]
