"""Token ids to the text a client sees: incremental detokenization with stop strings.
Text that might be the start of a stop string, or half of a multi-byte character, is held
back until the next token decides it."""

from __future__ import annotations

from typing import Protocol, Sequence

from engine.protocol import TokenLogprob
from queues.records import Scored


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


def piece(decoder: Decoder, token_id: int) -> tuple[str, list[int]]:
    """A token's text and bytes (engine.tokenizer.Tokenizer.piece where the decoder has it)."""
    own = getattr(decoder, "piece", None)
    text, raw = own(token_id) if own is not None else (decoder.decode([token_id]),) * 2
    return text, list(raw.encode() if isinstance(raw, str) else raw)


def scored(decoder: Decoder, entry: TokenLogprob | None, token_id: int) -> Scored:
    """An engine's TokenLogprob (None: the prompt's first token) as an answer shows it."""
    text, raw = piece(decoder, token_id)
    if entry is None:
        return Scored(text, None, raw, None)
    top = []
    for other, logprob in entry.top:
        other_text, other_raw = piece(decoder, other)
        top.append((other_text, logprob, other_raw))
    return Scored(text, entry.logprob, raw, top)


class TextStream:
    def __init__(self, decoder: Decoder, stop: Sequence[str] = (), ids: Sequence[int] = (), emitted: str = "") -> None:
        self.decoder = decoder
        self.stop = [s for s in stop if s]
        self.ids = list(ids)
        self.emitted = len(emitted)  # chars of the decoded text already sent
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token_id: int) -> str:
        """Add a generated token; return the text that is now safe to send."""
        self.ids.append(token_id)
        text = self.decoder.decode(self.ids)
        for stop in self.stop:
            at = text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at != -1:
                self.stopped = True
                return self._take(text, at)
        end = len(text) - self._hold
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            end = min(end, len(text) - 1)
        return self._take(text, end)

    def flush(self) -> str:
        """At the end (length, EOS): whatever was held back goes out."""
        if self.stopped:
            return ""
        return self._take(self.decoder.decode(self.ids), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        if end <= self.emitted:
            return ""
        piece = text[self.emitted:end]
        self.emitted = end
        return piece
