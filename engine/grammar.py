"""Constrained decoding: which tokens a row may sample next, from a grammar (llguidance).

A request's grammar arrives as an llguidance grammar string (shapes/constraints.py builds it from
`response_format` or a forced tool call, and checked it at the door). The worker's `Grammars`
compiles it on a thread of its own, off the step loop, once per distinct grammar (a cache by its
text); each request gets a copy of the compiled matcher (`deep_copy`, microseconds), its own
state. The sampler (engine/sampling.py) asks a row's `Constraint` for `allowed()` before it
picks, then tells it the token it chose (`accept`).

A reasoning model thinks first: with `after` (the text that ends its thinking, `</think>`) the
row is free until it has produced those tokens, and only then constrained.

A grammar that fails at run time (it does not compile with the model's tokenizer, or it reaches
a point where no token fits, e.g. when logit_bias banned every token it allows) fails its own
row only: the constraint keeps the error (`error`; `accept` never raises, as it is called in the
middle of a batch's sampling) and the engine ends that request alone (engine/errors.py RowsFailed)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NoReturn, Sequence

import llguidance
import numpy as np
import torch
from torch import Tensor

from engine.errors import RequestError

log = logging.getLogger(__name__)

CACHED_GRAMMARS = 256  # compiled grammars kept (each a few KiB to a few MiB)


class GrammarError(RequestError):
    """The request's grammar did not compile here, or left its row no token to take."""

    code = "grammar_error"


class Constraint:
    """One row's grammar state. `allowed()` is computed once per position and kept until `accept`."""

    def __init__(self, matcher: Future, vocab: int, after: str = "",
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self._future = matcher
        self._matcher: llguidance.LLMatcher | None = None
        self.vocab = vocab
        # the text that ends the free part (thinking; "" none), looked for in the last tokens'
        # text: a tokenizer without it as one token writes it in pieces that depend on what precedes
        self._after = after
        self._decode = decode
        self._recent: list[int] = []
        self._mask: Tensor | None = None
        self.error: GrammarError | None = None  # set once the grammar failed: the row's request ends

    @property
    def is_done(self) -> bool:
        """The grammar is complete and takes nothing more (only an end token)."""
        return not self._after and self._matcher is not None and self._matcher.is_stopped()

    def allowed(self) -> Tensor | None:
        """bool [vocab]: the tokens the grammar takes next; None while the row is still free."""
        if self.error is not None:
            raise self.error
        if self._after:
            return None
        if self._mask is None:
            matcher = self._ready()
            # llguidance's bitmask: token i is bit i % 32 of little-endian word i // 32, i.e. bit
            # i % 8 of byte i // 8; numpy unpacks it in one pass (~6 us for 49k tokens; torch's
            # shift-and-mask over [words, 32] took ~230 us)
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            mask = torch.from_numpy(bits[: self.vocab].view(np.bool_))
            if not bool(mask.any()):
                self._fail(f"the grammar allows no token here ({matcher.get_error() or 'a dead end'})")
            self._mask = mask
        return self._mask

    def accept(self, token: int) -> None:
        """The row's chosen token. A token outside the mask (the sampler had no allowed token left:
        logit_bias banned them all) or one the grammar refuses sets `error`; it never raises."""
        mask, self._mask = self._mask, None
        if self.error is not None:
            return
        if self._after:
            assert self._decode is not None
            self._recent = (self._recent + [token])[-len(self._after):]  # a token writes a character or more
            if self._after in self._decode(self._recent):
                self._after = ""  # thinking ended: the grammar starts at the next token
            return
        try:
            if mask is not None and not (0 <= token < mask.shape[0] and bool(mask[token])):
                self._fail(f"no token the grammar allows was left to sample (logit_bias removed all "
                           f"{int(mask.sum())} of them)")
            matcher = self._ready()
            if not matcher.consume_token(token):
                self._fail(f"token {token} does not fit the grammar: {matcher.get_error()}")
        except GrammarError:
            return  # kept in `error`

    def _fail(self, message: str) -> NoReturn:
        self.error = GrammarError(f"the answer's grammar (response_format or the forced tool call) failed: {message}")
        raise self.error

    def _ready(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            try:
                compiled = self._future.result()  # compiled while the prompt was read: rarely a wait
            except Exception as error:  # noqa: BLE001 - whatever the compiler raised is this request's
                self._fail(str(error) if isinstance(error, GrammarError) else f"the grammar does not compile: {error}")
            self._matcher = compiled.deep_copy()
        return self._matcher


class Grammars:
    """The worker's compiler: grammar text -> compiled matcher, on one thread, cached by text.
    The llguidance tokenizer (~1 s to build from the model's tokenizer) is built on that thread
    too, at the first grammar."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab: int, eos_token_ids: Sequence[int],
                 decode: Callable[[list[int]], str]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab = vocab
        self._eos = sorted(eos_token_ids)
        self._decode = decode
        self._ll: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, grammar: str, after: str | None = None) -> Constraint:
        """A fresh row state for `grammar`; its compilation starts now (or was cached)."""
        with self._lock:
            future = self._cache.get(grammar)
            if future is None:
                future = self._pool.submit(self._compile, grammar)
                self._cache[grammar] = future
                while len(self._cache) > CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(grammar)
        return Constraint(future, self.vocab, after or "", self._decode)

    def compiled(self, grammar: str) -> llguidance.LLMatcher:
        """Wait for `grammar`'s compiled matcher (the bench times it)."""
        return self.constraint(grammar)._future.result()

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        if self._ll is None:
            self._ll = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab, eos_token=self._eos)
        try:
            matcher = llguidance.LLMatcher(self._ll, grammar, log_level=0)
        except Exception as error:  # noqa: BLE001 - e.g. a grammar text llguidance cannot read
            raise GrammarError(f"the grammar does not compile: {error}") from None
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
