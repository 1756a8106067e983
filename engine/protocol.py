"""What a worker needs from an engine. The real engine (torch) and the fake engine (virtual
clock) both satisfy it, so the worker loop runs unchanged over either."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling, applied per row by engine/sampling.py in this order: the
    constraint's mask, logit_bias, the penalties, min_tokens; then temperature, top_k, top_p, min_p."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or less: off
    seed: int | None = None  # same seed, same prompt, same params -> same tokens
    min_tokens: int = 0  # end-of-sequence tokens are masked until this many were sampled
    already_sampled: int = 0  # tokens sampled before (a resumed request): its seeded stream continues after them
    min_p: float = 0.0  # tokens less likely than min_p x the top token's probability are cut (after temperature)
    presence_penalty: float = 0.0  # OpenAI's: subtracted from each token already in the answer
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token is in the answer
    repetition_penalty: float = 1.0  # transformers': a token of the prompt or answer, logit / p (> 0) or x p (< 0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -100 bans it
    logprobs: int | None = None  # None: none; N: each sampled token's log-probability and the N likeliest
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's too (echo), read from position 0
    grammar: str | None = None  # llguidance grammar text the answer follows (engine/grammar.py); None: free
    grammar_after: str | None = None  # the answer is free until it has written this (</think>)
    grammar_done: tuple[int, ...] = ()  # the answer's tokens from before (a resumed request): replayed into it

    @property
    def is_plain(self) -> bool:
        """No bias and no penalty: the logits go to temperature & co. as the model gave them."""
        return (not self.logit_bias and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and self.repetition_penalty == 1.0)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under its row's distribution, and the `top` likeliest tokens
    (id, log-probability), largest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class DecodePath:
    """How decode steps run: "eager", "compiled", or "compiling" (eager while the compiled step
    is built in the background; `percent`: an estimate of how far that build is)."""

    kind: str = "eager"
    percent: int = 0


class Engine(Protocol):
    num_slots: int
    ctx: int  # tokens of KV cache per slot
    eos_token_ids: frozenset[int]
    # A prompt token's cache entries are the same however its prompt was chunked or cached when
    # every read starts and ends on a multiple of this many positions (or at the prompt's end).
    prompt_block: int

    def begin(self, slot: int, params: SamplingParams, keep: int = 0) -> None:
        """Start a request in the slot: keep the first `keep` cached tokens (a prefix it shares
        with what the slot held before; 0 empties it) and reset the sampler (seeded if params.seed)."""

    def read(self, slot: int, tokens: Sequence[int], sample: bool) -> int | None:
        """Append one chunk of prompt tokens to the slot's cache at its current position (a
        prompt token's entries do not depend on the chunking, given reads on `prompt_block` edges).
        With sample=True (the prompt's last chunk), return the first generated token."""

    def fork(self, slot: int, into: Sequence[int]) -> list[int]:
        """The slot's read just ended with a sampled token: its cache is copied into each slot of
        `into` (each begun with its own params) and each one's first token is drawn from the same
        logits under its own sampler. The sibling answers of a request with n > 1."""

    def replay(self, slot: int, tokens: Sequence[int], sample: bool) -> int | None:
        """Append tokens the slot's request generated before (a resumed request) the way decode
        steps fed them, so their cache entries and the next token are the undisturbed run's.
        With sample=True (its last chunk), return the next generated token."""

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
        """One batched step: feed tokens[i] to slots[i] at its current position and return each
        slot's new tokens: the next one, then any the engine guessed after it and the step
        confirmed (the real engine's prompt lookup), exactly what one step per token would give.
        A slot advances by as many tokens as it returns: all but the last are in its cache, the
        last is fed by the next step. Rows whose request fails on its own account (its grammar)
        raise engine.errors.RowsFailed with the other rows' tokens: only those requests end."""

    def position(self, slot: int) -> int:
        """How many tokens the slot's cache holds."""

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first `length` cached tokens (reuse of a held prefix)."""

    def logprobs(self, slot: int) -> list[TokenLogprob]:
        """With params.logprobs: the TokenLogprob of each token read() and decode() returned for
        the slot since the last call, in order."""

    def prompt_logprobs(self, slot: int) -> list[TokenLogprob]:
        """With params.prompt_logprobs: each prompt token after the first, scored by the positions
        read so far (begin() with keep=0), since the last call."""

    def decode_path(self) -> DecodePath:
        """How decode steps run now; between steps (the worker's heartbeat), so a compiled step
        built in the background may take over here."""
