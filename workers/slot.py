"""One place in the worker's batch and the request it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.protocol import SamplingParams
from queues.records import QueuedRequest
from workers.text import TextStream


class Phase(enum.Enum):
    FREE = "free"
    READING = "reading"  # prompt being read into the KV cache, one chunk at a time
    DECODING = "decoding"
    # a sibling answer of a request with n > 1: its slot is held while the first answer's slot
    # reads the prompt, then takes a copy of that cache (engine fork) and decodes
    AWAITING_READ = "awaiting_read"


@dataclass
class Slot:
    index: int
    phase: Phase = Phase.FREE
    request: QueuedRequest | None = None
    claim_seq: int = 0  # the fence of its claim, and the order it got a slot (FCFS among reads of a level)
    tokens: list[int] = field(default_factory=list)  # what the cache must hold: prompt (+ resumed)
    read_pos: int = 0  # tokens of `tokens` already in the cache
    generated: int = 0  # tokens produced, including any from an earlier attempt
    last_token: int = -1
    text: TextStream | None = None
    yields: int = 0  # times this read gave way
    gave_way_to: str | None = None  # the read it let go first (its epoch)
    last_used: int = 0  # step when it was last freed: least-recently-used order
    cached: list[int] = field(default_factory=list)  # the prompt a free slot's KV cache still holds
    min_priority: int | None = None  # reserved (--reserve): only requests of this priority or higher
    choice: int = 0  # which of its request's n answers this slot holds
    params: SamplingParams | None = None  # what the engine's begin() got: again if its read catches up

    @property
    def is_reserved(self) -> bool:
        return self.min_priority is not None

    def admits(self, priority: int) -> bool:
        return self.min_priority is None or priority >= self.min_priority

    @property
    def is_free(self) -> bool:
        return self.phase is Phase.FREE

    @property
    def priority(self) -> int:
        return self.request.priority if self.request else 0

    @property
    def is_parked(self) -> bool:
        """A read stopped at a chunk boundary, its KV cache kept in the slot."""
        return self.phase is Phase.READING and self.read_pos > 0 and self.gave_way_to is not None

    def release(self, step: int, cached: list[int] | None = None) -> None:
        self.cached = cached or []
        self.phase = Phase.FREE
        self.request = None
        self.claim_seq = 0
        self.tokens = []
        self.read_pos = 0
        self.generated = 0
        self.last_token = -1
        self.text = None
        self.yields = 0
        self.gave_way_to = None
        self.choice = 0
        self.params = None
        self.last_used = step
