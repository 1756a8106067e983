"""Token ids to the text a client sees: incremental detokenization with stop strings.
Text that might be the start of a stop string, or half of a multi-byte character, is held
back until the next token decides it."""

from __future__ import annotations

from typing import Protocol, Sequence


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


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
