"""Read a GGUF file (llama.cpp's format) as the names `engine.model` expects.

Every quirk of the format is undone here, once, so the forward pass runs in Hugging Face layout:
- dims are listed innermost first (GGUF shape [in, out] is a torch [out, in] matrix);
- llama.cpp's converter permutes Q and K rows of `llama`-arch models for its interleaved RoPE;
- Qwen3-Next's joint q/gate projection and its DeltaNet projections are split into the parts
  the step reads (`_split_qwen3next`; each part is some rows of the file's blocks).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import Tensor, nn

from engine import rope
from engine.deltanet import DeltaNetShape, deinterleave, split_ba
from engine.errors import ConfigError
from engine.gguf_file import GGUFFile, GGUFTensor
from engine.model import ModelConfig
from engine.quants import blocks as quants
from engine.weights import DenseRows, Int4Blocks, RowTable

# Architectures whose Q/K rows llama.cpp's converter permuted (HF -> interleaved RoPE pairs).
_PERMUTED_QK = {"llama", "mistral"}
_SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma3", "qwen3next"}

_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    # MoE (Qwen3-MoE; Mixtral as `llama`): router, experts [E, ...] in one tensor each, shared expert
    "ffn_gate_inp": "router", "ffn_gate_exps": "experts_gate", "ffn_up_exps": "experts_up",
    "ffn_down_exps": "experts_down", "ffn_gate_shexp": "shared_gate", "ffn_up_shexp": "shared_up",
    "ffn_down_shexp": "shared_down", "ffn_gate_inp_shexp": "shared_router",
    # Gemma 3 (whose ffn_norm is its pre_feedforward_layernorm); its norms are stored as 1 + weight
    "post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_ffn_norm",
    # Qwen3-Next's Gated DeltaNet: legacy ssm_in (transformers' interleaved qkvz) or attn_qkv +
    # attn_gate (already in the convolution's order); ssm_a is -exp(A_log) already
    "ssm_in": "lin_qkvz", "ssm_ba": "lin_ba", "ssm_conv1d": "lin_conv", "ssm_dt": "lin_dt", "ssm_a": "lin_a_neg",
    "ssm_norm": "lin_norm", "ssm_out": "lin_out", "attn_qkv": "lin_qkv", "attn_gate": "lin_z",
}
# Per architecture, where a name means something else: Qwen3-Next's post_attention_norm is its
# FFN's input norm (transformers' post_attention_layernorm), not Gemma's norm of the output.
_ARCH_NAMES = {"qwen3next": {"post_attention_norm": "ffn_norm"}}


class GGUFModel:
    """An opened GGUF (parsed once, tensors mapped): its config, end-of-sequence ids, and its
    tensors as an `engine.weights.WeightSource` under engine.model's names, in HF layout."""

    def __init__(self, path: str | Path, cache_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path, cache_dir)
        self.arch = str(self._field("general.architecture"))
        if self.arch not in _SUPPORTED:
            raise ConfigError(f"unsupported GGUF architecture {self.arch!r} (supported: {sorted(_SUPPORTED)})")
        self._tensors: dict[str, GGUFTensor] = {}
        if any(name.count(".") == 4 and name.split(".")[2] in ("ffn_gate", "ffn_up", "ffn_down") for name in self.file.tensors):
            raise ConfigError("one tensor per expert (blk.N.ffn_gate.J.weight, an old Mixtral conversion) is not "
                             "supported: convert the model again with a current llama.cpp (ffn_*_exps tensors)")
        for tensor in self.file.tensors.values():
            name = _map_name(tensor.name, _ARCH_NAMES.get(self.arch, {}))
            if name is not None:  # nothing else is used by the architectures supported here
                self._tensors[name] = tensor
        # names computed from the file's tensors (dense float32), and the tensors they replace
        self._derived: dict[str, Callable[[], Tensor]] = {}
        self._picked: dict[str, tuple[GGUFTensor, Tensor]] = {}  # derived name -> (its tensor, its rows there)
        self.config = self._config()
        if self.arch == "qwen3next":
            self._split_qwen3next()

    def _field(self, key: str, default: Any = None) -> Any:
        return self.file.fields.get(key, default)

    def _config(self) -> ModelConfig:
        a = self.arch
        freqs = self.file.tensors.get("rope_freqs.weight")  # Llama 3.1's scaling, as divisors
        scaling = rope.from_gguf(self.file.fields, a, None if freqs is None else torch.tensor(dequantize_tensor(freqs)))
        dim = int(self._field(f"{a}.embedding_length"))
        n_heads = int(self._field(f"{a}.attention.head_count"))
        n_kv = int(self._field(f"{a}.attention.head_count_kv", n_heads))
        head_dim = int(self._field(f"{a}.attention.key_length", dim // n_heads))
        vocab = int(self._field(f"{a}.vocab_size", 0)) or len(self._field("tokenizer.ggml.tokens", []))
        names = set(self.file.tensors)
        n_layers = int(self._field(f"{a}.block_count"))
        extra = self._gemma(n_layers, dim, n_heads, head_dim) if a == "gemma3" else {}
        if a == "qwen3next":
            extra = self._qwen3next(n_layers, head_dim)
        return ModelConfig(
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            hidden_dim=int(self._field(f"{a}.feed_forward_length", 0)),
            vocab_size=vocab,
            norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_embeddings="output.weight" not in names,
            # any layer's (Qwen3-Next's first attention layer need not be layer 0)
            qkv_bias=any(n.endswith(".attn_q.bias") for n in names),
            qk_norm=any(n.endswith(".attn_q_norm.weight") for n in names),
            max_positions=int(self._field(f"{a}.context_length", 8192)),
            n_experts_used=int(self._field(f"{a}.expert_used_count", 0)),
            # llama.cpp renormalizes the chosen experts' weights for these architectures unless told
            norm_topk=bool(self._field(f"{a}.expert_weights_norm", True)),
            **extra,
        )

    def _gemma(self, n_layers: int, dim: int, n_heads: int, head_dim: int) -> dict[str, Any]:
        """Gemma 3 as llama.cpp runs it: every 6th layer global unless the file lists the sliding
        ones, the local RoPE base 10 000 unless given, the scores' scale 1/sqrt(head_dim) (the
        27B model's, 62 layers: 1/sqrt(dim/heads), which is its query_pre_attn_scalar), GELU,
        embeddings scaled by sqrt(dim); RoPE scaling on the global layers only."""
        a = self.arch
        pattern = self._field(f"{a}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, (list, tuple)):
            sliding = tuple(bool(p) for p in pattern)
        else:
            sliding = tuple((i + 1) % int(pattern) != 0 for i in range(n_layers))
        scale = self._field(f"{a}.attention.scale")
        if scale is None:
            scale = (dim / n_heads) ** -0.5 if n_layers == 62 else head_dim ** -0.5
        return dict(
            sliding_window=int(self._field(f"{a}.attention.sliding_window", 0)),
            sliding_layers=sliding,
            rope_local_theta=float(self._field(f"{a}.rope.freq_base_swa", 10000.0)),
            attn_scale=float(scale),
            final_softcap=float(self._field(f"{a}.final_logit_softcapping", 0.0)),
            embed_scale=float(dim) ** 0.5,
            activation="gelu_tanh",
        )

    def _qwen3next(self, n_layers: int, head_dim: int) -> dict[str, Any]:
        """Qwen3-Next as llama.cpp reads it: recurrent layers listed, or all but every
        full_attention_interval-th; the DeltaNet's heads from the ssm keys (k heads: group_count,
        v heads: time_step_rank, k_dim: state_size, v_dim: inner_size / v heads); RoPE on
        rope.dimension_count dims; the gated attention."""
        a = self.arch
        listed = self._field(f"{a}.attention.recurrent_layers")
        if isinstance(listed, (list, tuple)):
            linear = tuple(bool(x) for x in listed[:n_layers])
        else:
            interval = int(self._field(f"{a}.full_attention_interval", 4))
            linear = tuple((i + 1) % interval != 0 for i in range(n_layers))
        v_heads = int(self._field(f"{a}.ssm.time_step_rank"))
        shape = DeltaNetShape(n_k_heads=int(self._field(f"{a}.ssm.group_count")), n_v_heads=v_heads,
                              k_dim=int(self._field(f"{a}.ssm.state_size")),
                              v_dim=int(self._field(f"{a}.ssm.inner_size")) // v_heads,
                              kernel=int(self._field(f"{a}.ssm.conv_kernel")))
        return dict(linear_layers=linear, linear=shape, attn_gate=True,
                    rotary_dim=int(self._field(f"{a}.rope.dimension_count", head_dim)))

    def _split_qwen3next(self) -> None:
        """Each attention layer's attn_q [heads x (query, gate) x head_dim, dim] as q and q_gate;
        each DeltaNet layer's projections as lin_qkv, lin_z, lin_b, lin_a (engine/deltanet.py).
        A tensor is dequantized and split once when its first part is asked for; each part is
        kept only until it is taken (build takes each once).

        Every split only picks rows, so each part is also some rows of one of the file's tensors
        (`_picked`: the split run on the row numbers), and `quant` / `int4` hand out those rows
        of the file's blocks: the parts decode from the file's own bytes, like every other matrix
        of a quantized file, and in a form the compiled step takes; as dense copies they became
        oneDNN-prepacked bf16 linears on the CPU default, which inductor cannot lower."""
        cfg = self.config
        assert cfg.linear is not None
        shape = cfg.linear
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            split: Callable[..., Sequence[Tensor]]
            if cfg.is_linear(i):
                ba = self._tensors.pop(p + "lin_ba")
                if p + "lin_qkvz" in self._tensors:  # legacy: every part interleaved per key head
                    qkvz = self._tensors.pop(p + "lin_qkvz")
                    sources, split = (qkvz, ba), lambda qkvz, ba: deinterleave(qkvz, ba, shape)
                    names = {"lin_qkv": qkvz, "lin_z": qkvz, "lin_b": ba, "lin_a": ba}
                else:
                    sources, split = (ba,), lambda ba: split_ba(ba, shape)
                    names = {"lin_b": ba, "lin_a": ba}
            else:
                joint = self._tensors.pop(p + "q")
                sources, split = (joint,), lambda joint: [
                    half.reshape(cfg.q_size, -1) for half in joint.reshape(cfg.n_heads, 2, cfg.head_dim, -1).unbind(1)]
                names = {"q": joint, "q_gate": joint}
            parts = _split_once(lambda sources=sources, split=split: split(*(self._dense(t) for t in sources)))
            rows = split(*(torch.arange(t.shape[0]).unsqueeze(1) for t in sources))  # [part rows, 1] row numbers
            for j, (name, source) in enumerate(names.items()):
                self._derived[p + name] = lambda parts=parts, j=j: parts(j)
                self._picked[p + name] = (source, rows[j].view(-1))

    def eos_token_ids(self) -> list[int]:
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        return [int(self._field(k)) for k in keys if k in self.file.fields]

    def is_quantized(self) -> bool:
        """Any attention/MLP matrix stored in fewer bits than f16 (Q4_0, Q4_1, Q8_0, K-quants...)."""
        plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
        return any(t.qtype not in plain for n, t in self._tensors.items() if n.rsplit(".", 1)[-1] in _INT4_NAMES)

    # ---- engine.weights.WeightSource ------------------------------------------------------

    def names(self) -> set[str]:
        return set(self._tensors) | set(self._derived)

    def dense(self, name: str) -> Tensor:
        """float32 [out, in] (or [n] for a vector), exactly gguf's dequantize, rows in HF order."""
        if name in self._derived:
            return self._derived[name]()
        return self._dense(self._tensors[name], self._permuted_heads(name))

    def _dense(self, tensor: GGUFTensor, heads: int = 0) -> Tensor:
        if tensor.qtype in QuantRows.TYPES:  # gguf's numpy, then a copy, was much of a restart (the Q8_0 head)
            array = dequantize_blocks(torch.from_numpy(np.array(tensor.rows(), copy=True)), tensor.qtype)
            array = array.reshape(tensor.shape).numpy()
        else:
            blocks = self._blocks(tensor, heads)
            if blocks is not None:  # the same values from engine/quants' C++, rows already in HF order
                return quants.dequantize(blocks)  # (gguf's numpy took ~10x as long: the Q6_K head)
            array = dequantize_tensor(tensor)
        if heads:
            array = unpermute_rope_rows(array, heads)
        return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))  # memmap views are read-only

    def int4(self, name: str) -> Int4Blocks | None:
        if name in self._picked:  # a split part: its rows of the tensor's blocks
            tensor, rows = self._picked[name]
            if tensor.qtype not in _INT4_TYPES:
                return None
            return Int4Blocks(*(torch.from_numpy(np.ascontiguousarray(a))[rows] for a in unpack_q4(tensor)))
        if name in self._derived:
            return None
        tensor = self._tensors[name]
        if tensor.qtype not in _INT4_TYPES:
            return None
        q, scale, offset = unpack_q4(tensor)
        heads = self._permuted_heads(name)
        if heads:  # the same row un-permutation as dense()
            q, scale, offset = (unpermute_rope_rows(a, heads) for a in (q, scale, offset))
        return Int4Blocks(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, scale, offset)))

    def quant(self, name: str) -> quants.QuantBlocks | None:
        """A matrix as the file's own blocks (rows in HF order), for `engine.quants`' kernels;
        None for a type they do not take or when they are not built. A split part (`_picked`) is
        its rows of its tensor's blocks (every row is whole blocks): a copy of those bytes."""
        if name in self._picked:
            tensor, rows = self._picked[name]
            blocks = self._blocks(tensor, 0)
            return None if blocks is None else blocks._replace(raw=blocks.raw[rows])
        if name in self._derived:
            return None
        return self._blocks(self._tensors[name], self._permuted_heads(name))

    def release(self, name: str) -> None:
        """The model holds `name` in a form of its own now (engine/quants' repacked blocks): its
        file pages leave this process's RSS (they fault back in if read again)."""
        if name in self._picked:
            self.file.drop_tensor_pages(self._picked[name][0].name)
        elif name in self._tensors:
            self.file.drop_tensor_pages(self._tensors[name].name)

    def _blocks(self, tensor: GGUFTensor, heads: int) -> quants.QuantBlocks | None:
        """[rows, row_bytes], or [E, rows, row_bytes] for an MoE layer's stacked experts."""
        if len(tensor.shape) not in (2, 3) or not quants.shape_ok(tensor.qtype, tensor.shape[-1]) or not quants.available():
            return None
        raw = tensor.rows()
        if len(tensor.shape) == 3:
            raw = raw.reshape(*tensor.shape[:2], -1)
        if heads:  # each row is whole blocks: the same row un-permutation as dense()
            return quants.QuantBlocks(torch.from_numpy(unpermute_rope_rows(raw, heads).copy()), tensor.qtype, tensor.shape[1])
        # The mapped file's own pages, not a copy: nothing writes to them (the kernels read), the
        # page cache holds them once however many workers serve the file, and loading costs no copy.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return quants.QuantBlocks(torch.from_numpy(raw), tensor.qtype, tensor.shape[-1])

    def rows(self, name: str) -> RowTable:
        if name in self._derived:
            return DenseRows(self.dense(name))
        tensor = self._tensors[name]
        if tensor.qtype in QuantRows.TYPES:
            return QuantRows(tensor)
        blocks = self.quant(name)
        if blocks is not None:  # K-quants, IQ quants, Q5_0/Q5_1: the file's blocks, not a dense copy
            return quants.QuantRows(blocks)
        return DenseRows(self.dense(name))

    def _permuted_heads(self, name: str) -> int:
        if self.arch not in _PERMUTED_QK:
            return 0
        if name.endswith((".q", ".q_bias")):
            return self.config.n_heads
        if name.endswith((".k", ".k_bias")):
            return self.config.n_kv_heads
        return 0

    # ---- whole-model views (tests, tools) -------------------------------------------------

    def weights(self) -> dict[str, Tensor]:
        """All tensors dequantized to float32 (the exact reference; ~4 bytes a weight)."""
        return {name: self.dense(name) for name in self.names()}

    def int4_blocks(self) -> dict[str, Int4Blocks] | None:
        """The attention/MLP matrices as the file's own 4-bit blocks; None unless every one of
        them is Q4_0 or Q4_1."""
        out: dict[str, Int4Blocks] = {}
        for name in self._tensors:
            if name.rsplit(".", 1)[-1] not in _INT4_NAMES:
                continue
            blocks = self.int4(name)
            if blocks is None:
                return None
            out[name] = blocks
        return out


class QuantRows(nn.Module):
    """Rows of a quantized matrix kept as the file's blocks and dequantized on lookup: the
    embedding costs its file size (Q8_0: 1.06 bytes a weight) instead of a dense copy, and its
    rows are the file's exact values."""

    TYPES = {GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
             GGMLQuantizationType.F16, GGMLQuantizationType.F32, GGMLQuantizationType.BF16}

    def __init__(self, tensor: GGUFTensor) -> None:
        super().__init__()
        self.qtype = tensor.qtype
        self.dim = tensor.shape[-1]
        self.register_buffer("blocks", torch.from_numpy(np.array(tensor.rows(), copy=True)), persistent=False)  # [rows, row_bytes] uint8

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [...] long -> [..., dim] float32
        return dequantize_blocks(self.blocks[ids.reshape(-1)], self.qtype).reshape(*ids.shape, self.dim)


def dequantize_blocks(raw: Tensor, qt: GGMLQuantizationType) -> Tensor:
    """raw: [n, row_bytes] uint8, rows of one of `QuantRows.TYPES` -> [n, cols] float32, bit for bit
    gguf's dequantize (the same float32 products and sums, one operation at a time)."""
    n = raw.shape[0]
    if qt == GGMLQuantizationType.F32:
        return raw.view(torch.float32)
    if qt == GGMLQuantizationType.F16:
        return raw.view(torch.float16).float()
    if qt == GGMLQuantizationType.BF16:
        return raw.view(torch.bfloat16).float()
    if qt == GGMLQuantizationType.Q8_0:  # block: f16 d, 32 x int8 q; w = d * q
        blk = raw.view(n, -1, 34)
        d = blk[..., :2].contiguous().view(torch.float16).float()
        return (blk[..., 2:].contiguous().view(torch.int8).float() * d).reshape(n, -1)
    # Q4_0 / Q4_1: see unpack_q4
    header = 4 if qt == GGMLQuantizationType.Q4_1 else 2
    blk = raw.view(n, -1, header + 16)
    d = blk[..., :2].contiguous().view(torch.float16).float()
    m = blk[..., 2:4].contiguous().view(torch.float16).float() if header == 4 else -8 * d
    qs = blk[..., header:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    return (q * d + m).reshape(n, -1)


_INT4_NAMES = {"q", "k", "v", "o", "gate", "up", "down"}
_INT4_TYPES = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1}
Q4_GROUP = 32  # weights per block in Q4_0 / Q4_1


def unpack_q4(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0/Q4_1 matrix -> (q uint8 [out, in] in 0..15, scale, offset float32 [out, in/32]) with
    weight[r, c] = q[r, c] * scale[r, c//32] + offset[r, c//32], bit for bit what gguf's dequantize
    computes. Q4_1 block: f16 d, f16 m, 16 bytes (element j in the low nibble of byte j, element
    j+16 in its high nibble); w = q*d + m. Q4_0 block: f16 d, 16 bytes; w = (q-8)*d = q*d + (-8d)."""
    qtype = tensor.qtype
    rows, cols = tensor.shape
    header = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
    blocks = tensor.data.reshape(rows, cols // Q4_GROUP, header + 16)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_1:
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = scale * np.float32(-8)
    qs = blocks[..., header:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return q, scale, offset


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """float32 array in torch dim order ([out, in] for a matrix)."""
    if tensor.qtype == GGMLQuantizationType.F32:
        array = tensor.data.view(np.float32)
    elif tensor.qtype == GGMLQuantizationType.F16:
        array = tensor.data.view(np.float16).astype(np.float32)
    else:
        array = dequantize(tensor.rows(), tensor.qtype)
    return array.reshape(tensor.shape)


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation. Within each head it stored the rotation pairs
    interleaved (row 2i with 2i+1); HF keeps them half a head apart (row i with i + hd/2).
    weight: [n_heads*hd, ...] -> same shape, rows back in HF order."""
    rows = weight.shape[0]
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    # Stored order within a head is (i, parity) with parity fastest; HF order is (parity, i).
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _map_name(gguf_name: str, overrides: dict[str, str] | None = None) -> str | None:
    if gguf_name == "token_embd.weight":
        return "embed"
    if gguf_name == "output_norm.weight":
        return "norm"
    if gguf_name == "output.weight":
        return "output"
    parts = gguf_name.split(".")  # blk.N.attn_q.weight (Qwen3-Next's blk.N.ssm_a: no suffix)
    if parts[0] != "blk" or len(parts) not in (3, 4):
        return None
    base = (overrides or {}).get(parts[2]) or _LAYER_NAMES.get(parts[2])
    if base is None:
        return None
    suffix = "_bias" if parts[-1] == "bias" else ""
    return f"layers.{parts[1]}.{base}{suffix}"


def _split_once(make: Callable[[], Sequence[Tensor]]) -> Callable[[int], Tensor]:
    """Part j of what `make` splits a tensor into, made once for all its parts: each part is held
    until asked for, then let go (asked again, the tensor is split again)."""
    held: dict[int, Tensor] = {}

    def part(j: int) -> Tensor:
        if j not in held:
            held.update(enumerate(make()))
        return held.pop(j)

    return part
