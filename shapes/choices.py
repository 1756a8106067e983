"""A request's n answers (`n`, docs/api.md): its output stream interleaves their events, each
tagged with its choice (queues/records.py), and it ends at the n-th Done, one per answer. This
gathers them for a whole answer (the API's, a batch line's, a lookup by id) and words the body
with the endpoint's Shape: one choice per answer, `index` = its choice, usage counting the
prompt once."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from queues.records import Done, Scored, Token
from shapes.answers import Answer, Job, Shape
from shapes.responses import Usage


@dataclass
class Collected:
    """One answer's token events so far: text pieces and logprobs (the echoed prompt's first)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[Scored] = field(default_factory=list)

    def add(self, event: Token) -> None:
        self.text.append(event.text)
        self.logprobs += (event.prompt_logprobs or []) + event.logprobs

    def answer(self, done: Done) -> Answer:
        return Answer("".join(self.text), done.finish_reason, Usage.of(done.prompt_tokens, done.completion_tokens),
                      self.logprobs or None)


@dataclass
class Choices:
    """The answers of one request of `n`, gathered from its events in stream order."""

    n: int = 1
    parts: dict[int, Collected] = field(default_factory=dict)
    ended: dict[int, Done] = field(default_factory=dict)

    def add(self, event: Token | Done) -> bool:
        """True once every answer has ended."""
        if isinstance(event, Token):
            self.parts.setdefault(event.choice, Collected()).add(event)
        else:
            self.ended[event.choice] = event
        return self.is_done

    @property
    def is_done(self) -> bool:
        return len(self.ended) >= self.n

    def answers(self) -> list[Answer]:
        return [self.parts.get(i, Collected()).answer(self.ended[i]) for i in sorted(self.ended)]


def whole(shape: Shape, job: Job, answers: list[Answer]) -> BaseModel:
    """The endpoint's body for these answers: the first's, with a choice per answer and the
    usage of all (the prompt once, every answer's tokens)."""
    bodies = [shape.whole(job, answer) for answer in answers]
    body = bodies[0]
    if len(bodies) > 1:
        body.choices = [b.choices[0].model_copy(update={"index": i}) for i, b in enumerate(bodies)]
        body.usage = Usage.of(answers[0].usage.prompt_tokens, sum(a.usage.completion_tokens for a in answers))
    return body


def indexed(chunks: list[BaseModel], choice: int) -> list[BaseModel]:
    """Stream chunks of one answer, each choice in them given that answer's `index`."""
    if choice:
        for chunk in chunks:
            for entry in chunk.choices:
                entry.index = choice
    return chunks
