"""The fake engine on the wall clock, for `strata worker --engine fake`: the same deterministic
tokens as engine/fake.py, but each read and decode step really takes its configured time, so the
API, the queues and the worker loop can be loaded without a model (bench/load.py).

Its text is the fake's own (token 7 reads " t7"): a worker needs no tokenizer and loads no
weights. The API still tokenizes prompts with the model file's tokenizer, so prompt lengths,
context checks and the request hash are what a real deployment sees."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.fake import FakeEngine, VirtualClock

CALLS_KEPT = 256  # a long-running worker keeps only the latest calls: memory stays flat


@dataclass
class SleepingClock(VirtualClock):
    """Time passes for real: advance(ms) sleeps that long (and still counts it)."""

    def advance(self, ms: float) -> None:
        if ms > 0:
            time.sleep(ms / 1000)
        super().advance(ms)


def live_fake_engine(num_slots: int, ctx: int, read_ms_per_token: float, decode_ms_per_step: float,
                     vocab: int = 1000) -> FakeEngine:
    return FakeEngine(num_slots=num_slots, ctx=ctx, vocab=vocab, read_ms_per_token=read_ms_per_token,
                      decode_ms_per_step=decode_ms_per_step, clock=SleepingClock(),
                      calls=deque(maxlen=CALLS_KEPT))  # type: ignore[arg-type] - only appended to
