"""The worker loop: admit into free slots, advance one read by a chunk (the lines), decode all
decoding slots together, report the step to Redis, finish what ended. Decisions come from
workers/scheduler.py; this file only carries them out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.protocol import Engine, SamplingParams
from queues.claims import Claimed, Claims
from queues.records import Done, Event, Failed, Token
from workers import scheduler
from workers.slot import Phase, Slot
from workers.text import Decoder, TextStream

log = logging.getLogger("strata.worker")


def wall_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class StepOutput:
    tokens: list[tuple[str, Token]] = field(default_factory=list)
    ended: list[tuple[Slot, Event, str]] = field(default_factory=list)  # slot, last event, status


class Worker:
    def __init__(
        self,
        engine: Engine,
        claims: Claims,
        decoder: Decoder,
        *,
        prefill_chunk: int,
        device: str = "cpu",
        heartbeat_ms: int = 1000,
        idle_wait_s: float = 0.5,
        clock: Callable[[], int] = wall_ms,
    ) -> None:
        self.engine = engine
        self.claims = claims
        self.decoder = decoder
        self.prefill_chunk = prefill_chunk
        self.device = device
        self.heartbeat_ms = heartbeat_ms
        self.idle_wait_s = idle_wait_s
        self.clock = clock
        self.slots = [Slot(i) for i in range(engine.num_slots)]
        self.steps = 0
        self.stopping = False
        self._next_beat = 0

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        log.info("worker %s serving %d slots", self.claims.worker_id, len(self.slots))
        try:
            while not self.stopping:
                if not self.step():
                    self.claims.wait_for_work(self.idle_wait_s)
        finally:
            self.stop()

    def stop(self) -> None:
        """Hand back whatever is still running; the next worker resumes it."""
        active = [s.request.id for s in self.slots if s.request]
        back = self.claims.give_back(active, self.clock())
        if back:
            log.info("gave back %d requests", len(back))
        for slot in self.slots:
            if slot.request:
                slot.release(self.steps)
        self.claims.leave()

    def step(self) -> bool:
        """One turn of the loop; False when there was nothing to do."""
        now = self.clock()
        if now >= self._next_beat:
            self._maintain(now)
        self.steps += 1
        self._admit(now)
        out = StepOutput()
        read = scheduler.next_read(self.slots)
        decoding = scheduler.decoding(self.slots)  # before the read, so a slot never gets two tokens in one step
        if read:
            self._read_chunk(read, out)
        if decoding:
            self._decode(decoding, out)
        running = [s.request.id for s in self.slots if s.request]
        cancelled = self.claims.report(out.tokens, running, self.clock())
        ended_ids = set()
        for slot, event, status in out.ended:
            ended_ids.add(slot.request.id)
            self.claims.finish(slot.request.id, event, status, slot.generated, self.clock())
            slot.release(self.steps)
        for slot in self.slots:
            if slot.request and slot.request.id in cancelled and slot.request.id not in ended_ids:
                self.claims.finish(slot.request.id, None, "cancelled", slot.generated, self.clock())
                slot.release(self.steps)
        return bool(read or decoding)

    # -- the parts --------------------------------------------------------------------------
    def _maintain(self, now: int) -> None:
        back = self.claims.requeue_expired(now)
        if back:
            log.warning("requeued %d requests whose worker stopped renewing: %s", len(back), back)
        self.claims.heartbeat(self.describe(), now, ttl_s=max(3, 5 * self.heartbeat_ms // 1000))
        self._next_beat = now + self.heartbeat_ms

    def describe(self) -> dict[str, str | int]:
        """The worker hash an operator reads with HGETALL."""
        read = scheduler.next_read(self.slots)
        busy = sum(not s.is_free for s in self.slots)
        fields: dict[str, str | int] = {
            "device": self.device,
            "slots_total": len(self.slots),
            "slots_busy": busy,
            "steps": self.steps,
            "reading": read.request.id if read and read.request else "",
        }
        if read and read.request:
            fields.update(
                reading_priority=read.priority,
                reading_prompt_tokens=len(read.tokens),
                reading_progress=read.read_pos,
                reading_yields=read.yields,
            )
        return fields

    def _admit(self, now: int) -> None:
        while not self.stopping:
            slot = scheduler.free_slot(self.slots)
            if slot is None:
                return
            head = self.claims.head()
            if not head:
                return
            claimed = self.claims.claim(head[0], slot.index, now)
            if claimed:
                self._start(slot, claimed)

    def _start(self, slot: Slot, claimed: Claimed) -> None:
        request = claimed.request
        resumed = self.claims.resumed(request.id) if claimed.attempts > 1 else None
        done_ids = resumed.token_ids if resumed else []
        slot.request = request
        slot.seq = claimed.claim_seq
        slot.tokens = list(request.prompt) + done_ids
        slot.read_pos = 0
        slot.generated = len(done_ids)
        slot.text = TextStream(self.decoder, request.stop, done_ids, resumed.text if resumed else "")
        slot.phase = Phase.READING
        self.engine.begin(
            slot.index,
            SamplingParams(
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                seed=request.seed,
                min_tokens=max(0, request.min_tokens - len(done_ids)),
            ),
        )
        log.info("slot %d <- %s (priority %d, %d tokens%s)", slot.index, request.id, request.priority,
                 len(slot.tokens), f", resumed after {len(done_ids)}" if done_ids else "")

    def _read_chunk(self, slot: Slot, out: StepOutput) -> None:
        if len(slot.tokens) >= self.engine.ctx:
            out.ended.append((slot, Failed("prompt does not fit the context", "context_length_exceeded"), "failed"))
            return
        chunk = slot.tokens[slot.read_pos : slot.read_pos + self.prefill_chunk]
        last = slot.read_pos + len(chunk) == len(slot.tokens)
        try:
            token = self.engine.read(slot.index, chunk, sample=last)
        except Exception as error:  # noqa: BLE001 - one bad request must not take the worker down
            log.exception("read failed for %s", slot.request.id)
            out.ended.append((slot, Failed(f"engine error: {error}"), "failed"))
            return
        slot.read_pos += len(chunk)
        if last:
            slot.phase = Phase.DECODING
            self._accept(slot, token, out)

    def _decode(self, slots: list[Slot], out: StepOutput) -> None:
        try:
            tokens = self.engine.decode([s.index for s in slots], [s.last_token for s in slots])
        except Exception as error:  # noqa: BLE001
            log.exception("decode step failed")
            for slot in slots:
                out.ended.append((slot, Failed(f"engine error: {error}"), "failed"))
            return
        for slot, token in zip(slots, tokens):
            self._accept(slot, token, out)

    def _accept(self, slot: Slot, token: int, out: StepOutput) -> None:
        """A token was sampled for this slot: stream it and decide whether the request ends."""
        request = slot.request
        slot.generated += 1
        slot.last_token = token
        if token in self.engine.eos_token_ids and not request.ignore_eos:
            self._end(slot, "stop", out, tail=slot.text.flush())
            return
        out.tokens.append((request.id, Token(slot.text.push(token), [token])))
        if slot.text.stopped:
            self._end(slot, "stop", out)
        elif slot.generated >= request.max_tokens or self.engine.position(slot.index) >= self.engine.ctx:
            self._end(slot, "length", out, tail=slot.text.flush())

    def _end(self, slot: Slot, reason: str, out: StepOutput, tail: str = "") -> None:
        if tail:
            out.tokens.append((slot.request.id, Token(tail, [])))
        done = Done(reason, len(slot.request.prompt), slot.generated)
        out.ended.append((slot, done, "finished"))
