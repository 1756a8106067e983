"""The real engine: a Transformer, its slots' positions and samplers, behind engine.protocol.Engine."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from engine.files import is_gguf, resolve_model_path, served_model_name
from engine.model import KV_BUCKET, Int4Blocks, ModelConfig, Transformer
from engine.protocol import SamplingParams
from engine.sampling import SlotSampler, sample_tokens
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class TorchEngine:
    """Satisfies engine.protocol.Engine. Not thread-safe: one worker loop drives it."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, *, model_name: str, eos_token_ids: frozenset[int]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.num_slots = model.num_slots
        self.ctx = model.ctx
        self.eos_token_ids = eos_token_ids
        self.device = model.embed.weight.device
        self.dtype = model.embed.weight.dtype
        self._positions = [0] * self.num_slots
        self._samplers = [SlotSampler.start(SamplingParams(temperature=0.0)) for _ in range(self.num_slots)]

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def begin(self, slot: int, params: SamplingParams, keep: int = 0) -> None:
        self._check_slot(slot)
        self.truncate(slot, keep)
        self._samplers[slot] = SlotSampler.start(params)

    def read(self, slot: int, tokens: Sequence[int], sample: bool) -> int | None:
        self._check_slot(slot)
        start = self._positions[slot]
        if len(tokens) == 0:
            raise ValueError("read() needs at least one token")
        if start + len(tokens) > self.ctx:
            raise ValueError(f"slot {slot}: {start} cached + {len(tokens)} new tokens exceed ctx={self.ctx}")
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model.prefill(slot, ids, start, need_logits=sample)
        self._positions[slot] = start + len(tokens)
        if not sample:
            return None
        return sample_tokens(logits.unsqueeze(0), [self._samplers[slot]], self.eos_token_ids)[0]

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> list[int]:
        if len(slots) != len(tokens):
            raise ValueError("decode() needs one token per slot")
        if not slots:
            return []
        if len(set(slots)) != len(slots):
            raise ValueError("decode() got the same slot twice")
        for slot in slots:
            self._check_slot(slot)
            if self._positions[slot] >= self.ctx:
                raise ValueError(f"slot {slot} is full (ctx={self.ctx})")
        positions = [self._positions[s] for s in slots]
        span = min(self.ctx, -(-(max(positions) + 1) // KV_BUCKET) * KV_BUCKET)
        lo = slots[0]
        contiguous = list(slots) == list(range(lo, lo + len(slots)))
        dev = self.device
        with torch.inference_mode():
            logits = self.model.decode(
                torch.tensor(list(slots), dtype=torch.long, device=dev),
                torch.tensor(list(tokens), dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                span,
                (lo, lo + len(slots)) if contiguous else None,
            )
        for slot in slots:
            self._positions[slot] += 1
        return sample_tokens(logits, [self._samplers[s] for s in slots], self.eos_token_ids)

    def position(self, slot: int) -> int:
        self._check_slot(slot)
        return self._positions[slot]

    def truncate(self, slot: int, length: int) -> None:
        # Cached entries past `length` stay in memory but every mask hides them until overwritten.
        self._check_slot(slot)
        if not 0 <= length <= self._positions[slot]:
            raise ValueError(f"slot {slot}: cannot truncate {self._positions[slot]} tokens to {length}")
        self._positions[slot] = length

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range (num_slots={self.num_slots})")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA; float32 on the CPU. CPU bf16 (prepacked, float32 residual and attention) is
    faster at B>=4 but its greedy top token still agreed with float32 slightly less often than
    transformers' own bf16 on SmolLM2 (213 vs 214 of 217 positions, all near-ties; see
    docs/engine.md), so it is opt-in there: dtype="bfloat16"."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def load_engine(
    model_path: str | Path | None,
    *,
    num_slots: int = 4,
    ctx: int = 2048,
    device: str = "cpu",
    dtype: str | None = None,
    threads: int | None = None,
    int4_decode: bool = False,
) -> TorchEngine:
    """Open a GGUF file or HF folder (None: the default SmolLM2) and allocate its slots.

    int4_decode: on the CPU, with a GGUF whose attention/MLP matrices are all Q4_0/Q4_1, decode
    steps of <= 8 rows use int4 copies built from the file's blocks (see docs/engine.md); ignored
    with a warning elsewhere (CUDA, HF folders, other quant types)."""
    if num_slots < 1 or ctx < 1:
        raise ValueError("num_slots and ctx must be positive")
    if threads is not None:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: use 'cpu' or 'cuda:N'")
    if dtype is None:
        torch_dtype = default_dtype(dev)
    elif dtype in _DTYPES:
        torch_dtype = _DTYPES[dtype]
    else:
        raise ValueError(f"unsupported dtype {dtype!r} (use one of {sorted(_DTYPES)})")

    path = resolve_model_path(model_path)
    int4_blocks = None
    if is_gguf(path):
        from engine.gguf_loader import GGUFModel

        gguf = GGUFModel(path)
        config, weights, file_eos = gguf.config, gguf.weights(), gguf.eos_token_ids()
        if int4_decode and dev.type == "cpu":
            int4_blocks = gguf.int4_blocks()
            if int4_blocks is None:
                log.warning("int4_decode: %s has linears that are not Q4_0/Q4_1; decoding dense", path.name)
    else:
        from engine import hf_loader

        config, weights, file_eos = hf_loader.read_config(path), hf_loader.load_weights(path), []
    if int4_decode and dev.type != "cpu":
        log.warning("int4_decode is CPU-only; ignored on %s", dev)
    elif int4_decode and not is_gguf(path):
        log.warning("int4_decode needs a Q4_0/Q4_1 GGUF file; %s is not one, decoding dense", path.name)
    tokenizer = Tokenizer.from_model_path(path, extra_eos_ids=file_eos)
    return build_engine(
        config, weights, tokenizer, model_name=served_model_name(path),
        num_slots=num_slots, ctx=ctx, device=dev, dtype=torch_dtype, int4_blocks=int4_blocks,
    )


def build_engine(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer | None,
    *,
    model_name: str,
    num_slots: int,
    ctx: int,
    device: torch.device,
    dtype: torch.dtype,
    eos_token_ids: frozenset[int] | None = None,
    prepack: bool = True,
    int4_blocks: dict[str, Int4Blocks] | None = None,
) -> TorchEngine:
    """An engine from loaded parts (tests reuse one loaded file for several dtypes/slot counts).
    int4_blocks (GGUFModel.int4_blocks()): attach int4 copies for small decode steps (CPU only)."""
    model = Transformer.from_weights(config, weights, dtype=dtype, device=device)
    if prepack:
        model.prepack_cpu_bf16()  # a no-op unless CPU + bf16
    if int4_blocks is not None and not model.attach_int4(int4_blocks):
        log.warning("int4_decode: no CPU int4 kernel here; decoding dense")
    model.allocate_cache(num_slots, ctx)
    if eos_token_ids is None:
        eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
    return TorchEngine(model, tokenizer, model_name=model_name, eos_token_ids=eos_token_ids)
