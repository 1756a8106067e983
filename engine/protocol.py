"""What a worker needs from an engine. The real engine (torch) and the fake engine (virtual
clock) both satisfy it, so the worker loop runs unchanged over either."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or less: off
    seed: int | None = None  # same seed, same prompt, same params -> same tokens
    min_tokens: int = 0  # end-of-sequence tokens are masked until this many were sampled
    already_sampled: int = 0  # tokens sampled before (a resumed request): its seeded stream continues after them


class Engine(Protocol):
    num_slots: int
    ctx: int  # tokens of KV cache per slot
    eos_token_ids: frozenset[int]

    def begin(self, slot: int, params: SamplingParams, keep: int = 0) -> None:
        """Start a request in the slot: keep the first `keep` cached tokens (a prefix it shares
        with what the slot held before; 0 empties it) and reset the sampler (seeded if params.seed)."""

    def read(self, slot: int, tokens: Sequence[int], sample: bool) -> int | None:
        """Append one chunk of prompt tokens to the slot's cache at its current position.
        With sample=True (the prompt's last chunk), return the first generated token."""

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
        """One batched step: feed tokens[i] to slots[i] at its current position and return each
        slot's new tokens: the next one, then any the engine guessed after it and the step
        confirmed (the real engine's prompt lookup), exactly what one step per token would give.
        A slot advances by as many tokens as it returns: all but the last are in its cache, the
        last is fed by the next step."""

    def position(self, slot: int) -> int:
        """How many tokens the slot's cache holds."""

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first `length` cached tokens (reuse of a held prefix)."""
