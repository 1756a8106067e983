"""Token acceptance: what becomes of the tokens sampled for one slot in one step. Each is
counted and streamed as text (workers/text.py holds back what might start a stop string), until
the request ends: its EOS token (unless ignore_eos), a stop string, max_tokens, or a context
that is full. What comes after the token that ended it is dropped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Sequence

from queues.records import Done, Scored, Token
from workers.slot import Slot


@dataclass
class Accepted:
    events: list[Token] = field(default_factory=list)  # to stream, in order
    done: Done | None = None  # the request ended: its last event

    @property
    def goes_on(self) -> bool:
        return self.done is None


def accept(slot: Slot, tokens: Sequence[int], *, eos_token_ids: Collection[int], context_full: bool,
           logprobs: Sequence[Scored] | None = None) -> Accepted:
    """`tokens`: sampled for `slot` this step, in order (more than one: guesses the step
    confirmed, engine/lookup.py). `context_full`: the slot's cache is at the engine's ctx.
    `logprobs`: each token's, when the request asked (they go on its token event)."""
    request = slot.request
    taken = Accepted()
    for i, token in enumerate(tokens):
        slot.generated += 1
        slot.last_token = token
        if token in eos_token_ids and not request.ignore_eos:
            return _end(slot, taken, "stop", slot.text.flush())
        taken.events.append(Token(slot.text.push(token), [token], [logprobs[i]] if logprobs else [],
                                  choice=slot.choice))
        if slot.text.stopped:
            return _end(slot, taken, "stop")
        if slot.generated >= request.max_tokens or context_full:
            return _end(slot, taken, "length", slot.text.flush())
    return taken


def _end(slot: Slot, taken: Accepted, reason: str, tail: str = "") -> Accepted:
    if tail:
        taken.events.append(Token(tail, [], choice=slot.choice))
    taken.done = Done(reason, len(slot.request.prompt), slot.generated, slot.choice)
    return taken
