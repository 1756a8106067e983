"""Opening a model: its file or folder, the dtype and weight forms for the device, the slots, and
(the default) the compiled decode step; the engine it makes is engine/runner.py's."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine import kv_dtype as kv_dtypes
from engine.errors import ConfigError
from engine.files import is_gguf, resolve_model_path
from engine.memory import ensure_kv_fits, release_freed_memory
from engine.model import ModelConfig, Transformer
from engine.runner import TorchEngine
from engine.tokenizer import Tokenizer
from engine.weights import DictSource, WeightSource

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def default_dtype(device: torch.device, quantized_file: bool) -> torch.dtype:
    """bf16 on CUDA. On the CPU, bf16 (int4 where the file has Q4 blocks, float32 residual,
    attention and top logits) for a quantized GGUF: its weights are already coarser than bf16's
    rounding, and greedy continuations stay as close to the float32 dequantized model as
    llama.cpp's own (docs/engine.md). float32 for unquantized files, where exactness is the point."""
    if device.type == "cuda" or quantized_file:
        return torch.bfloat16
    return torch.float32


def load_engine(
    model_path: str | Path | None,
    *,
    num_slots: int = 4,
    ctx: int | None = 2048,
    device: str = "cpu",
    dtype: str | None = None,
    threads: int | None = None,
    int4: bool = True,
    prefill_bf16: bool = True,
    prompt_int8: bool = True,
    repack: bool = True,
    cache_dir: str | Path | None = None,
    compile: bool = True,
    compile_in_background: bool = False,
    prompt_lookup: bool = True,
    kv_tokens: int | None = None,
    kv_dtype: str | None = None,
) -> TorchEngine:
    """Open a GGUF file or HF folder (None: the default SmolLM2) and allocate its slots.

    dtype None: see `default_dtype`. int4: with bf16 on the CPU, linears stored as Q4_0/Q4_1 run
    straight from the file's blocks (engine/quants' repacked dots, Q4_1's with 16-bit activations, where
    the CPU has AVX2, else torch's int4 kernel: Transformer.build); off, they are dequantized to
    bf16 (more memory, faster prompt reading). prefill_bf16: with int4, each such matrix also
    keeps a bf16 prepacked copy that prefill chunks use where oneDNN prepacks bf16 (+2 bytes a
    weight), but where the blocks' own bf16 tile reads those prompts (with prompt_int8, AVX-512
    BF16 without AMX: engine/quants/blocks.py `bf16_prompt_here`): there no copy is made; off,
    prompts go as the file's blocks' (with prompt_int8 in integers: Q4_1's 16-bit, Q4_0's int8).
    prompt_int8: a quantized file's matrices multiply prompt tokens in int8 where the CPU does
    that faster than bf16 or float32 (AVX2 or AVX-512 VNNI without AMX: engine/quants/blocks.py
    `int8_prompt_here`, `int8_prompt_of`); off: bf16 slabs (float32 on AVX2 alone), closer to float32.
    repack: its Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K matrices held repacked eight rows
    at a time for the decode step's dots where the CPU has AVX2 (engine/quants/blocks.py
    `repacked`: exact, Q4_K 1.03x the bytes, the rest 1.00x); off: the file's pages.
    cache_dir: where the converted tokenizer is kept so a restart does not convert it again
    (seconds for a GGUF), and inductor's generated code.
    compile: decode compiled (engine/compiled.py; on the CPU the layers ahead of time, engine/aot.py),
    built here or loaded from cache_dir; off: eager. compile_in_background (a worker's default):
    what is not cached is built by a low-priority child process while the engine decodes eagerly,
    and takes over between steps once built (engine/background.py).
    prompt_lookup: on the CPU with two slots or more, a one-row step also checks a guess of the next
    token from the slot's own text (engine/lookup.py), the same tokens sooner when it is right.
    ctx: the most positions one request may hold (None: the model's own context); kv_tokens: the KV pool every slot's blocks come
    from (None: num_slots x ctx, each slot its own blocks until the worker's pool assigns them); kv_dtype: what
    the pool stores, float32 / bfloat16 / int8 / fp8 (CUDA) (None or auto: engine/kv_dtype.py `resolve`)."""
    if num_slots < 1 or (ctx is not None and ctx < 1):
        raise ValueError("num_slots and ctx must be positive")
    if threads is not None:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {device!r}: use 'cpu' or 'cuda:N'")
    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r} (use one of {sorted(_DTYPES)})")

    started = time.perf_counter()
    path = resolve_model_path(model_path)
    source: WeightSource
    if is_gguf(path):
        from engine.gguf_loader import GGUFModel

        gguf = GGUFModel(path, cache_dir)
        config, source, file_eos, quantized = gguf.config, gguf, gguf.eos_token_ids(), gguf.is_quantized()
    else:
        from engine import hf_loader

        config, source, file_eos, quantized = (
            hf_loader.read_config(path), DictSource(hf_loader.load_weights(path)), [], False)
    torch_dtype = _DTYPES[dtype] if dtype is not None else default_dtype(dev, quantized)
    if ctx is None:  # requests up to the model's own context
        ctx = config.max_positions
    # a KV cache that cannot fit even at 2 bytes a value is refused now, not after minutes of
    # loading; the exact size is checked again once the weights are in (Transformer.allocate_cache)
    pool = num_slots * ctx if kv_tokens is None else kv_tokens
    cache_dtype = kv_dtypes.resolve(kv_dtype, dev, torch_dtype)
    at_least = cache_dtype if cache_dtype.itemsize < 2 else torch.bfloat16
    ensure_kv_fits(config.kv_cache_bytes(pool, at_least), dev, pool, at_least=True)
    tokenizer = Tokenizer.from_model_path(path, extra_eos_ids=file_eos, cache_dir=cache_dir, chat=False)
    engine = build_engine(config, source, tokenizer, num_slots=num_slots, ctx=ctx, device=dev,
                          dtype=torch_dtype, int4=int4, prefill_bf16=prefill_bf16, prompt_int8=prompt_int8,
                          repack=repack, kv_tokens=kv_tokens, kv_dtype=kv_dtype)
    release_freed_memory()
    if is_gguf(path):  # what was converted at load no longer counts in the worker's RSS
        source.file.drop_pages()  # type: ignore[attr-defined]
    if compile:
        from engine.compiled import use_cache_dir

        use_cache_dir(cache_dir)
        if compile_in_background:
            engine.compile_in_background()
        else:
            engine.compile_decode(warm=True)
    if prompt_lookup and engine.can_look_up:
        engine.use_prompt_lookup()
    log.info("loaded %s in %.1fs: %s, linears %s, KV pool %.0f MiB (%s, %d bytes a token)", path.name,
             time.perf_counter() - started, torch_dtype, engine.model.forms, engine.model.kv_bytes() / 2**20,
             engine.model.cache_dtype, config.kv_bytes_per_token(engine.model.cache_dtype))
    return engine


def build_engine(
    config: ModelConfig,
    source: WeightSource | dict[str, torch.Tensor],
    tokenizer: Tokenizer | None,
    *,
    num_slots: int,
    ctx: int,
    device: torch.device,
    dtype: torch.dtype,
    eos_token_ids: frozenset[int] | None = None,
    int4: bool = True,
    prepack: bool = True,
    prefill_bf16: bool = True,
    prompt_int8: bool = True,
    repack: bool = True,
    kv_tokens: int | None = None,
    kv_dtype: str | None = None,
) -> TorchEngine:
    """An engine from loaded parts (tests reuse one opened file for several dtypes/slot counts).
    A plain dict of float32 tensors is a source without 4-bit blocks."""
    if isinstance(source, dict):
        source = DictSource(source)
    model = Transformer.build(config, source, dtype=dtype, device=device, int4=int4, prepack=prepack,
                              prefill_bf16=prefill_bf16, prompt_int8=prompt_int8, repack=repack)
    model.cache_dtype = kv_dtypes.resolve(kv_dtype, device, dtype)
    model.allocate_cache(num_slots, ctx, kv_tokens)
    if eos_token_ids is None:
        eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
    return TorchEngine(model, tokenizer, eos_token_ids=eos_token_ids)

