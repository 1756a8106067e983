"""The real engine: a Transformer, its slots' positions and samplers, behind engine.protocol.Engine."""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from engine.errors import ConfigError
from engine.files import is_gguf, resolve_model_path
from engine.grammar import Constraint, Grammars
from engine.lookup import Lookup
from engine.memory import ensure_kv_fits
from engine.model import KV_BUCKET, CacheIndex, ModelConfig, Transformer
from engine.protocol import SamplingParams, TokenLogprob
from engine.sampling import SlotSampler, sample_tokens, score_prompt
from engine.tokenizer import Tokenizer
from engine.weights import DictSource, WeightSource

if TYPE_CHECKING:
    from engine.compiled import CompiledDecode

log = logging.getLogger(__name__)

SCORE_ROWS = 128  # prompt scoring: positions whose logits are made at once

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class TorchEngine:
    """Satisfies engine.protocol.Engine. Not thread-safe: one worker loop drives it."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, *, eos_token_ids: frozenset[int]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.num_slots = model.num_slots
        self.ctx = model.ctx
        self.eos_token_ids = eos_token_ids
        self.device = model.device
        self.dtype = model.dtype
        self._positions = [0] * self.num_slots
        self._samplers = [SlotSampler.start(SamplingParams(temperature=0.0)) for _ in range(self.num_slots)]
        self.compiled: CompiledDecode | None = None
        self.grammars: Grammars | None = None  # made at the first constrained request
        self._lookups: list[Lookup] | None = None  # prompt lookup's, one a slot (use_prompt_lookup)
        self._held: list[list[int]] = [[] for _ in range(self.num_slots)]  # the ids each slot's cache holds
        # prompt scoring (params.prompt_logprobs): each slot's scored prompt tokens so far, and the
        # last read position's logits, which score the first token of the next chunk
        self._prompt_scores: list[list[TokenLogprob]] = [[] for _ in range(self.num_slots)]
        self._carry: list[torch.Tensor | None] = [None] * self.num_slots

    @property
    def prompt_lookup(self) -> bool:
        return self._lookups is not None

    @property
    def can_look_up(self) -> bool:
        """Prompt lookup is exact only where a row's logits are the same whatever shares its step
        (the CPU), and its step has two rows, which the compiled steps take only with two slots."""
        return self.device.type == "cpu" and self.num_slots >= 2

    def use_prompt_lookup(self, on: bool = True) -> None:
        """A one-row decode step also checks guesses of the tokens after it (engine/lookup.py),
        yielding more than one token when they were right: exactly those of decoding one at a time."""
        if on and not self.can_look_up:
            raise ValueError("prompt lookup needs the CPU (row-independent kernels) and two slots")
        # a slot's earlier tokens are unknown here: its guesses start from what comes next (a
        # guess only decides whether a row is spent, never which tokens come out)
        self._lookups = [Lookup() for _ in range(self.num_slots)] if on else None

    def compile_decode(self, warm: bool = True, ahead: bool = True) -> float:
        """Decode through torch.compile from now on (engine/compiled.py); with `warm`, build the
        graphs now, and with `ahead` the steps' layers compiled ahead of time (engine/aot.py).
        Returns the seconds spent warming. Layers in oneDNN's prepacked form decode eagerly
        (`compiled.compilable`), and `compiled` stays None."""
        from engine.compiled import CompiledDecode, compilable

        if not compilable(self.model):
            log.warning("decoding eagerly: the compiled step cannot take oneDNN-prepacked linears, engine/quants "
                        "kernels or layers of different kinds (%s)", self.model.forms)
            return 0.0
        self.compiled = CompiledDecode(self.model)
        if not warm:
            return 0.0
        return self.compiled.warm(sorted({1, min(2, self.num_slots), self.num_slots}), min(self.ctx, KV_BUCKET),
                                  ahead=ahead)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def begin(self, slot: int, params: SamplingParams, keep: int = 0) -> None:
        self._check_slot(slot)
        if params.prompt_logprobs is not None and keep:
            raise ValueError("prompt scoring reads the prompt from its first token (keep=0)")
        self.truncate(slot, keep)
        self._samplers[slot] = sampler = SlotSampler.start(params, self._constraint(params))
        sampler.observe(self._held[slot])
        self._prompt_scores[slot], self._carry[slot] = [], None

    def _constraint(self, params: SamplingParams) -> Constraint | None:
        """The row state of the request's grammar, compiled on the grammar thread (engine/grammar.py)."""
        if params.grammar is None:
            return None
        if self.grammars is None:
            if self.tokenizer is None:
                raise ValueError("a constrained request needs the model's tokenizer")
            tokenizer = self.tokenizer
            self.grammars = Grammars(tokenizer.json, self.config.vocab_size, sorted(self.eos_token_ids),
                                     lambda text: tokenizer.encode_plain(text))
        constraint = self.grammars.constraint(params.grammar, params.grammar_after)
        for token in params.grammar_done:
            constraint.accept(token)
        return constraint

    def _allowed(self, slots: Sequence[int]) -> torch.Tensor | None:
        """[rows, V] bool on the device: each constrained row's allowed tokens, a free row's all
        True; None when no row is constrained now (Transformer.exact_top)."""
        masks = [self._samplers[s].constraint.allowed() if self._samplers[s].constraint is not None else None
                 for s in slots]
        if all(m is None for m in masks):
            return None
        vocab = self.config.vocab_size
        allowed = torch.ones(len(slots), vocab, dtype=torch.bool)
        for row, mask in enumerate(masks):
            if mask is not None:
                allowed[row, :mask.shape[0]] = mask[:vocab]
        return allowed.to(self.device)

    def logprobs(self, slot: int) -> list[TokenLogprob]:
        """The TokenLogprob of each token read() and decode() returned for the slot since the last
        call (params.logprobs), in order."""
        return self._samplers[slot].take_logprobs()

    def prompt_logprobs(self, slot: int) -> list[TokenLogprob]:
        """The prompt's tokens after its first, scored as read so far (params.prompt_logprobs)."""
        taken, self._prompt_scores[slot] = self._prompt_scores[slot], []
        return taken

    def read(self, slot: int, tokens: Sequence[int], sample: bool) -> int | None:
        self._check_slot(slot)
        start = self._positions[slot]
        if len(tokens) == 0:
            raise ValueError("read() needs at least one token")
        end = start + len(tokens)
        if end > self.ctx:
            raise ValueError(f"slot {slot}: {start} cached + {len(tokens)} new tokens exceed ctx={self.ctx}")
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device).unsqueeze(0)
        index = CacheIndex.for_slots([slot], positions, span=end)
        sampler = self._samplers[slot]
        scoring = sampler.params.prompt_logprobs
        with torch.inference_mode():
            if scoring is None:
                hidden = self.model(ids, index)
                logits = self.model.logits(hidden, self._allowed([slot])) if sample else None
            else:
                logits = self._score_prompt(slot, list(tokens), self.model.forward_all(ids, index)[0], scoring)
                logits = logits if sample else None
        self._fed(slot, list(tokens))
        if logits is None:
            return None
        return sample_tokens(logits, [sampler], self.eos_token_ids)[0]

    def _score_prompt(self, slot: int, tokens: list[int], h: torch.Tensor, top: int) -> torch.Tensor:
        """h [T, dim]: this chunk's final-normed rows. Row i's logits score token i + 1; the
        previous chunk's last row scores this chunk's first token, and this chunk's last row waits
        for the next chunk (returned: it is also what the first answer token is drawn from). A read
        that gives way keeps these (the slot's state): its scores are those of one whole read.
        Logits are made SCORE_ROWS rows at a time (a [T, V] float32 block is 200 KB a row)."""
        carry = self._carry[slot]
        for lo in range(0, h.shape[0], SCORE_ROWS):
            logits = self.model.logits(h[lo:lo + SCORE_ROWS])
            rows = logits[:-1] if carry is None else torch.cat([carry, logits[:-1]])
            first = lo + (1 if carry is None else 0)
            targets = tokens[first:lo + logits.shape[0]]
            if targets:
                self._prompt_scores[slot] += score_prompt(rows.cpu(), targets, top)
            carry = logits[-1:].clone()
        self._carry[slot] = carry
        return carry

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
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
        # penalties and constraints follow the tokens one by one: such a row decodes without guesses
        if self._lookups is not None and len(slots) == 1 and self._samplers[slots[0]].is_plain:
            return [self._decode_guessing(slots[0], tokens[0])]
        slots = list(slots)
        logits = self._step(slots, list(tokens), [self._positions[s] for s in slots], self._allowed(slots))
        for slot, token in zip(slots, tokens):
            self._fed(slot, [token])
        return [[t] for t in sample_tokens(logits, [self._samplers[s] for s in slots], self.eos_token_ids)]

    def _decode_guessing(self, slot: int, token: int) -> list[int]:
        """One row, and one more at each next position for the tokens guessed after it, as many as
        fit: the step's rows are at most the slots (the batched package's largest batch), and a
        full slot ends its request, so the guesses never take its last position. Row i's token
        counts only while every guess before it was right: it then read what one step at a time
        would have."""
        assert self._lookups is not None
        position = self._positions[slot]
        room = min(self.num_slots - 1, self.ctx - position - 2)
        guesses = self._lookups[slot].guess(token)[:max(room, 0)]
        rows = [token, *guesses]
        logits = self._step([slot] * len(rows), rows, list(range(position, position + len(rows))))
        sampler = self._samplers[slot]
        out = sample_tokens(logits[:1], [sampler], self.eos_token_ids)
        for row, guess in enumerate(guesses, start=1):
            if out[-1] != guess:
                break
            out += sample_tokens(logits[row:row + 1], [sampler], self.eos_token_ids)
        self._fed(slot, rows[:len(out)])
        return out

    def _step(self, slots: list[int], tokens: list[int], positions: list[int],
              allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of one token each at these positions of their slots -> logits [rows, V] (allowed:
        constrained rows' tokens, for the head's exact top; `_allowed`)."""
        span = min(self.ctx, -(-(max(positions) + 1) // KV_BUCKET) * KV_BUCKET)
        dev = self.device
        with torch.inference_mode():
            pos = torch.tensor(positions, dtype=torch.long, device=dev)
            ids = torch.tensor(tokens, dtype=torch.long, device=dev)
            if self.compiled is not None:
                return self.compiled(ids, torch.tensor(slots, dtype=torch.long, device=dev), pos, span, allowed)
            hidden = self.model(ids.unsqueeze(1), CacheIndex.for_slots(slots, pos.unsqueeze(1), span))
            return self.model.logits(hidden, allowed)

    def _fed(self, slot: int, tokens: list[int]) -> None:
        self._positions[slot] += len(tokens)
        self._held[slot] += tokens
        self._samplers[slot].observe(tokens)
        if self._lookups is not None:
            self._lookups[slot].extend(tokens)

    def position(self, slot: int) -> int:
        self._check_slot(slot)
        return self._positions[slot]

    def truncate(self, slot: int, length: int) -> None:
        # Cached entries past `length` stay in memory but every mask hides them until overwritten.
        self._check_slot(slot)
        if not 0 <= length <= self._positions[slot]:
            raise ValueError(f"slot {slot}: cannot truncate {self._positions[slot]} tokens to {length}")
        self._positions[slot] = length
        del self._held[slot][length:]
        if self._lookups is not None:
            self._lookups[slot].truncate(length)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range (num_slots={self.num_slots})")


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
    ctx: int = 2048,
    device: str = "cpu",
    dtype: str | None = None,
    threads: int | None = None,
    int4: bool = True,
    prefill_bf16: bool = True,
    cache_dir: str | Path | None = None,
    compile: bool = True,
    prompt_lookup: bool = True,
) -> TorchEngine:
    """Open a GGUF file or HF folder (None: the default SmolLM2) and allocate its slots.

    dtype None: see `default_dtype`. int4: with bf16 on the CPU, linears stored as Q4_0/Q4_1 run
    as int4 straight from the file's blocks (the only copy kept); off, they are dequantized to
    bf16 (more memory, faster prompt reading). prefill_bf16: with int4, each int4 matrix also keeps
    a bf16 prepacked copy that prefill chunks use (2.3x faster there; +2 bytes a weight).
    cache_dir: where the converted tokenizer is kept so a restart does not convert it again
    (seconds for a GGUF), and inductor's generated code.
    compile: decode compiled (engine/compiled.py; on the CPU the layers ahead of time, engine/aot.py),
    built here or loaded from cache_dir; off: eager.
    prompt_lookup: on the CPU with two slots or more, a one-row step also checks a guess of the next
    token from the slot's own text (engine/lookup.py), the same tokens sooner when it is right."""
    if num_slots < 1 or ctx < 1:
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
    # a KV cache that cannot fit even at 2 bytes a value is refused now, not after minutes of
    # loading; the exact size is checked again once the weights are in (Transformer.allocate_cache)
    ensure_kv_fits(config.kv_cache_bytes(num_slots, ctx, torch.bfloat16), dev, num_slots, ctx, at_least=True)
    tokenizer = Tokenizer.from_model_path(path, extra_eos_ids=file_eos, cache_dir=cache_dir, chat=False)
    engine = build_engine(config, source, tokenizer, num_slots=num_slots, ctx=ctx, device=dev,
                          dtype=torch_dtype, int4=int4, prefill_bf16=prefill_bf16)
    release_freed_memory()
    if is_gguf(path):  # what was converted at load no longer counts in the worker's RSS
        source.file.drop_pages()  # type: ignore[attr-defined]
    if compile:
        from engine.compiled import use_cache_dir

        use_cache_dir(cache_dir)
        engine.compile_decode(warm=True)
    if prompt_lookup and engine.can_look_up:
        engine.use_prompt_lookup()
    log.info("loaded %s in %.1fs: %s, linears %s, KV cache %.0f MiB", path.name, time.perf_counter() - started,
             torch_dtype, engine.model.forms, engine.model.kv_bytes() / 2**20)
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
) -> TorchEngine:
    """An engine from loaded parts (tests reuse one opened file for several dtypes/slot counts).
    A plain dict of float32 tensors is a source without 4-bit blocks."""
    if isinstance(source, dict):
        source = DictSource(source)
    model = Transformer.build(config, source, dtype=dtype, device=device, int4=int4, prepack=prepack,
                              prefill_bf16=prefill_bf16)
    model.allocate_cache(num_slots, ctx)
    if eos_token_ids is None:
        eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
    return TorchEngine(model, tokenizer, eos_token_ids=eos_token_ids)


def release_freed_memory() -> None:
    """Loading frees large temporaries (dequantized float32 matrices, unpacked nibbles); glibc
    keeps such pages in the process unless asked to hand them back."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
