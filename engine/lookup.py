"""Guessing a slot's next token from its own text: where its last few tokens occurred before, the
token that followed them then (prompt lookup).

A one-row decode step on the CPU is bound by reading the weights (docs/engine.md): a second row in
the same step, at the next position, costs ~18 % more, and when the guess was right the step
yields two tokens. Right guesses are common where a model repeats or quotes its prompt
(summaries, code edits, lists). The step checks the guess, so the tokens are the ones decoding
one at a time would give; a wrong guess costs only its row.

Only a run of SHORTEST tokens or more is looked up: the guesses a single matching token adds were
right 24 % of the time on SmolLM2's chat answers, about what the second row costs; those of runs
of 2 to 4, 65 % (`bench.prompt_lookup`, docs/engine.md "Prompt lookup").

After a run of LONGEST the CHAIN tokens that followed it are guessed, each in a row of its own:
the first is then right ~86 % of the time and, when it is, the next ~89 %, while four rows cost
~1.7x one (docs/engine.md, "Three guesses after a run of four").

No torch here: a dict from each n-gram (n = SHORTEST..LONGEST) to the position of the token that
followed its latest occurrence, kept up to date as tokens are appended.
"""

from __future__ import annotations

from typing import Sequence

SHORTEST, LONGEST = 2, 4  # runs of tokens looked up, the longest first
CHAIN = 3  # tokens guessed after a run of LONGEST: what followed it then, in order


class Lookup:
    """One slot's tokens (what its cache holds, in order) and where each n-gram was last followed.
    `shortest`, `longest`: the runs looked up (bench/prompt_lookup.py measures other lengths)."""

    def __init__(self, shortest: int = SHORTEST, longest: int = LONGEST, chain: int = CHAIN) -> None:
        self.shortest, self.longest, self.chain = shortest, longest, chain
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending just before `token` are followed by it
            for n in range(self.shortest, min(self.longest, end) + 1):
                self._after[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def truncate(self, length: int) -> None:
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self._after = [], {}
            self.extend(kept)

    def guess(self, last: int) -> list[int]:
        """The tokens after `last` (about to be fed after the held tokens), or none: the longest
        run ending in `last` that occurred before, and what followed it that time: one token, or
        up to `chain` after a run of `longest` (its followers are then right ~9 times in 10)."""
        for n in range(min(self.longest, len(self.tokens) + 1), self.shortest - 1, -1):
            run = (*self.tokens[len(self.tokens) - n + 1:], last)
            at = self._after.get(run)
            if at is not None:
                count = self.chain if n == self.longest else 1
                return [*self.tokens[at:at + count], last][:count]  # the held tokens, then `last`
        return []
