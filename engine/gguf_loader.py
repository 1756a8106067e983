"""Load a GGUF file (llama.cpp's format) into the names `engine.model` expects.

Every quirk of the format is undone here, once, so the forward pass runs in Hugging Face layout:
- dims are listed innermost first (GGUF shape [in, out] is a torch [out, in] matrix);
- llama.cpp's converter permutes Q and K rows of `llama`-arch models for its interleaved RoPE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.model import Int4Blocks, ModelConfig

# Architectures whose Q/K rows llama.cpp's converter permuted (HF -> interleaved RoPE pairs).
_PERMUTED_QK = {"llama", "mistral"}
_SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}

_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
}


class GGUFModel:
    """An opened GGUF: its config, end-of-sequence ids and tensors (dequantized on demand)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = GGUFReader(self.path)  # slow (~6 s on SmolLM2): it parses the token list
        self.arch = str(self._field("general.architecture"))
        if self.arch not in _SUPPORTED:
            raise ValueError(f"unsupported GGUF architecture {self.arch!r} (supported: {sorted(_SUPPORTED)})")
        self.config = self._config()

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _config(self) -> ModelConfig:
        a = self.arch
        dim = int(self._field(f"{a}.embedding_length"))
        n_heads = int(self._field(f"{a}.attention.head_count"))
        n_kv = int(self._field(f"{a}.attention.head_count_kv", n_heads))
        head_dim = int(self._field(f"{a}.attention.key_length", dim // n_heads))
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = int(self._field(f"{a}.vocab_size", 0)) or len(tokens.data)
        names = {t.name for t in self.reader.tensors}
        scaling = self._field(f"{a}.rope.scaling.type")
        if (scaling not in (None, "none")) or "rope_freqs.weight" in names:
            raise ValueError(f"RoPE scaling ({scaling or 'rope_freqs'}) is not supported yet")
        return ModelConfig(
            dim=dim,
            n_layers=int(self._field(f"{a}.block_count")),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            hidden_dim=int(self._field(f"{a}.feed_forward_length")),
            vocab_size=vocab,
            norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            tie_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            max_positions=int(self._field(f"{a}.context_length", 8192)),
        )

    def eos_token_ids(self) -> list[int]:
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        return [int(self._field(k)) for k in keys if k in self.reader.fields]

    def weights(self) -> dict[str, torch.Tensor]:
        """All tensors as float32 torch tensors under engine.model's names, in HF layout."""
        cfg = self.config
        out: dict[str, torch.Tensor] = {}
        for tensor in self.reader.tensors:
            name = _map_name(tensor.name)
            if name is None:
                continue  # nothing else is used by the architectures supported here
            array = dequantize_tensor(tensor)
            if self.arch in _PERMUTED_QK and name.endswith((".q", ".q_bias")):
                array = unpermute_rope_rows(array, cfg.n_heads)
            elif self.arch in _PERMUTED_QK and name.endswith((".k", ".k_bias")):
                array = unpermute_rope_rows(array, cfg.n_kv_heads)
            out[name] = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))  # memmap views are read-only
        return out


    def int4_blocks(self) -> dict[str, Int4Blocks] | None:
        """The attention/MLP matrices as the file's own 4-bit blocks (for `Transformer.attach_int4`),
        under the same names and in the same HF row order as `weights()`; None unless every one of
        them is Q4_0 or Q4_1. The embedding and the output head are not included."""
        cfg = self.config
        out: dict[str, Int4Blocks] = {}
        for tensor in self.reader.tensors:
            name = _map_name(tensor.name)
            if name is None or name.rsplit(".", 1)[-1] not in _INT4_NAMES:
                continue
            if GGMLQuantizationType(tensor.tensor_type) not in _INT4_TYPES:
                return None
            q, scale, offset = unpack_q4(tensor)
            heads = cfg.n_heads if name.endswith(".q") else cfg.n_kv_heads if name.endswith(".k") else 0
            if self.arch in _PERMUTED_QK and heads:  # the same row un-permutation as weights()
                q, scale, offset = (unpermute_rope_rows(a, heads) for a in (q, scale, offset))
            out[name] = Int4Blocks(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, scale, offset)))
        return out


_INT4_NAMES = {"q", "k", "v", "o", "gate", "up", "down"}
_INT4_TYPES = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1}
Q4_GROUP = 32  # weights per block in Q4_0 / Q4_1


def unpack_q4(tensor: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0/Q4_1 matrix -> (q uint8 [out, in] in 0..15, scale, offset float32 [out, in/32]) with
    weight[r, c] = q[r, c] * scale[r, c//32] + offset[r, c//32], bit for bit what gguf's dequantize
    computes. Q4_1 block: f16 d, f16 m, 16 bytes (element j in the low nibble of byte j, element
    j+16 in its high nibble); w = q*d + m. Q4_0 block: f16 d, 16 bytes; w = (q-8)*d = q*d + (-8d)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    rows, cols = (int(d) for d in reversed(tensor.shape))
    header = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // Q4_GROUP, header + 16)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_1:
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = scale * np.float32(-8)
    qs = blocks[..., header:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return q, scale, offset


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """One ReaderTensor -> float32 array in torch dim order ([out, in] for a matrix)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dim first
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = np.asarray(tensor.data, dtype=np.float32)
    else:
        array = dequantize(tensor.data, qtype)
    return array.reshape(shape)


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation. Within each head it stored the rotation pairs
    interleaved (row 2i with 2i+1); HF keeps them half a head apart (row i with i + hd/2).
    weight: [n_heads*hd, ...] -> same shape, rows back in HF order."""
    rows = weight.shape[0]
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    # Stored order within a head is (i, parity) with parity fastest; HF order is (parity, i).
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _map_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "embed"
    if gguf_name == "output_norm.weight":
        return "norm"
    if gguf_name == "output.weight":
        return "output"
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if parts[0] != "blk" or len(parts) != 4:
        return None
    base = _LAYER_NAMES.get(parts[2])
    if base is None:
        return None
    suffix = "_bias" if parts[3] == "bias" else ""
    return f"layers.{parts[1]}.{base}{suffix}"
