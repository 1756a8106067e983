"""A fake engine with the real engine's interface, deterministic tokens and a virtual clock.
It serves scheduler tests and simulations: the worker loop runs over it unchanged, and time
passes only when it reads or decodes: a flat cost per prompt token and per decode step, or, given
a measured cost profile (engine/cost_profile.py, `strata calibrate`), the real engine's cost by
context, chunk length and batch size."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from engine.cost_profile import CostProfile
from engine.protocol import DecodePath, SamplingParams, TokenLogprob


@dataclass
class VirtualClock:
    now_ms: int = 0
    carry_ms: float = 0.0  # the fraction of a ms not yet shown: measured costs are not whole ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: float) -> None:
        exact = self.carry_ms + ms
        whole = math.floor(exact + 1e-9)
        self.carry_ms = exact - whole
        self.now_ms += whole


@dataclass
class Call:
    """One engine call, as a test reads it back."""

    kind: str  # "read", "replay" (a resumed request's generated tokens), "fork" (n answers) or "decode"
    slots: tuple[int, ...]
    tokens: int  # prompt tokens read, or rows decoded
    at_ms: int


class FakeDecoder:
    """Token ids to text: token 7 reads " t7"."""

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f" t{i}" for i in ids)


@dataclass
class FakeEngine:
    num_slots: int = 4
    ctx: int = 4096
    vocab: int = 1000
    eos_token_id: int = 0
    read_ms_per_token: float = 1.0
    decode_ms_per_step: float = 10.0
    clock: VirtualClock = field(default_factory=VirtualClock)
    calls: list[Call] = field(default_factory=list)
    tokenizer: FakeDecoder = field(default_factory=FakeDecoder)
    profile: CostProfile | None = None  # set: costs as measured (the flat costs above are ignored)
    path: DecodePath = field(default_factory=DecodePath)  # what decode_path says (no step is compiled here)
    prompt_block: int = 1  # its tokens depend on nothing but the cache: any chunking reads the same
    # a paged KV pool of this many tokens (the worker then admits by memory, workers/kv_pool.py);
    # None: each slot its own ctx, as before the pool. Its tables are checked, not used.
    kv_tokens: int | None = None
    kv_block: int = 16

    def __post_init__(self) -> None:
        self._step_started = False
        self._cache: list[list[int]] = [[] for _ in range(self.num_slots)]
        self._params = [SamplingParams() for _ in range(self.num_slots)]
        self._logprobs: list[list[TokenLogprob]] = [[] for _ in range(self.num_slots)]
        self._prompt_logprobs: list[list[TokenLogprob]] = [[] for _ in range(self.num_slots)]
        self.tables: list[list[int]] = [[] for _ in range(self.num_slots)]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.eos_token_id})

    def begin(self, slot: int, params: SamplingParams, keep: int = 0) -> None:
        if keep > len(self._cache[slot]):
            raise ValueError("cannot keep more than the slot holds")
        del self._cache[slot][keep:]
        self._params[slot] = params
        self._logprobs[slot], self._prompt_logprobs[slot] = [], []

    def assign(self, slot: int, blocks: Sequence[int], tokens: Sequence[int] | None = None) -> None:
        """The real engine's: the slot's block table, and (tokens) the cached prefix it holds."""
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"slot {slot}: a block twice in its table")
        self.tables[slot] = list(blocks)
        if tokens is not None:
            self._cache[slot] = list(tokens)

    def _check_room(self, slot: int, end: int) -> None:
        if self.kv_tokens is not None and end > len(self.tables[slot]) * self.kv_block:
            raise ValueError(f"slot {slot}: writing up to {end} beyond its {len(self.tables[slot])} blocks")

    def read(self, slot: int, tokens: Sequence[int], sample: bool) -> int | None:
        if len(self._cache[slot]) + len(tokens) > self.ctx:
            raise ValueError("chunk does not fit the slot's context")
        self._check_room(slot, len(self._cache[slot]) + len(tokens))
        self._charge_step()
        self.clock.advance(self.read_cost_ms(len(self._cache[slot]), len(tokens)))
        if self._params[slot].prompt_logprobs is not None:  # each token after the slot's first
            cached = self._cache[slot]
            self._prompt_logprobs[slot] += [fake_logprob(t, self._params[slot].prompt_logprobs)
                                            for i, t in enumerate(tokens) if cached or i]
        self._cache[slot].extend(tokens)
        self.calls.append(Call("read", (slot,), len(tokens), self.clock.now_ms))
        return self._next(slot) if sample else None

    def fork(self, slot: int, into: Sequence[int]) -> list[int]:
        """The slot's cache copied into each of `into`, no time charged (a copy, no model pass);
        each first token is its own: it depends on the seed."""
        for target in into:
            self._check_room(target, len(self._cache[slot]))
            self._cache[target] = list(self._cache[slot])
        self.calls.append(Call("fork", (slot, *into), 0, self.clock.now_ms))
        return [self._next(target) for target in into]

    def replay(self, slot: int, tokens: Sequence[int], sample: bool) -> int | None:
        """A resumed request's generated tokens, fed as the real engine does: decode steps of up
        to num_slots rows of this slot, each charged as one."""
        if len(self._cache[slot]) + len(tokens) > self.ctx:
            raise ValueError("tokens do not fit the slot's context")
        self._check_room(slot, len(self._cache[slot]) + len(tokens))
        self._charge_step()
        for lo in range(0, len(tokens), self.num_slots):
            rows = list(tokens[lo:lo + self.num_slots])
            self._cache[slot].extend(rows)
            self.clock.advance(self.decode_cost_ms(len(rows), len(self._cache[slot])))
        self.calls.append(Call("replay", (slot,), len(tokens), self.clock.now_ms))
        return self._next(slot) if sample else None

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
        for slot in slots:
            self._check_room(slot, len(self._cache[slot]) + 1)
        self._charge_step()
        self.clock.advance(self.decode_cost_ms(len(slots), max(len(self._cache[s]) for s in slots) + 1))
        for slot, token in zip(slots, tokens):
            self._cache[slot].append(token)
        self.calls.append(Call("decode", tuple(slots), len(slots), self.clock.now_ms))
        return [[self._next(slot)] for slot in slots]

    def start_step(self) -> None:
        """The worker loop starts a step (at most one read and one decode): its own cost, the
        profile's step_overhead_ms, is charged once, at the step's first engine call, so a step
        with nothing to do costs nothing. Whoever drives the loop calls this (simulate/fleet.py);
        without it no overhead is charged."""
        self._step_started = True

    def _charge_step(self) -> None:
        if self._step_started and self.profile is not None:
            self.clock.advance(self.profile.step_overhead_ms)
        self._step_started = False

    def read_cost_ms(self, cached: int, tokens: int) -> float:
        if self.profile is None:
            return self.read_ms_per_token * tokens
        return self.profile.read_ms(cached, tokens)

    def decode_cost_ms(self, rows: int, context: int) -> float:
        """`context`: the longest row's, this step's token included (what attention spans)."""
        if self.profile is None:
            return self.decode_ms_per_step
        return self.profile.decode_ms(rows, context)

    def position(self, slot: int) -> int:
        return len(self._cache[slot])

    def truncate(self, slot: int, length: int) -> None:
        del self._cache[slot][length:]

    def decode_path(self) -> DecodePath:
        return self.path

    def prompt_tokens_read(self) -> int:
        return sum(c.tokens for c in self.calls if c.kind == "read")

    def logprobs(self, slot: int) -> list[TokenLogprob]:
        taken, self._logprobs[slot] = self._logprobs[slot], []
        return taken

    def prompt_logprobs(self, slot: int) -> list[TokenLogprob]:
        taken, self._prompt_logprobs[slot] = self._prompt_logprobs[slot], []
        return taken

    def _next(self, slot: int) -> int:
        """Depends only on what the slot holds (and the seed): batch and solo agree."""
        cache = self._cache[slot]
        seed = self._params[slot].seed or 0
        token = (sum(cache) * 31 + len(cache) + seed) % (self.vocab - 1) + 1  # never EOS by itself
        if self._params[slot].logprobs is not None:
            self._logprobs[slot].append(fake_logprob(token, self._params[slot].logprobs))
        return token


def fake_logprob(token: int, top: int) -> TokenLogprob:
    """A made-up but fixed logprob: -(token % 10 + 1) / 10, the token first among `top`."""
    value = -(token % 10 + 1) / 10
    return TokenLogprob(token, value, tuple((token + i, value - i) for i in range(top)))
