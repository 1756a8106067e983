"""A worker's upkeep of the fleet, once a heartbeat: take back claims whose worker stopped
renewing them or died on this host, expire requests past their queue_timeout, publish the
worker hash (`describe`), and keep the idle signal true. None of it serves a request; all of
it keeps the fleet honest when some worker does not."""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

from engine.protocol import DecodePath
from queues.claims import Claims
from queues.membership import Membership, Peer
from queues.worker_state import WorkerState
from workers.admission import Admission
from workers.blocks import BlockPool
from workers.slot import Phase, Slot

log = logging.getLogger("strata.worker")


class Upkeep:
    def __init__(self, claims: Claims, membership: Membership, *, heartbeat_ms: int,
                 is_dead: Callable[[str], bool]) -> None:
        self.claims = claims
        self.membership = membership
        self.heartbeat_ms = heartbeat_ms
        self.is_dead = is_dead  # another worker's id -> its process is known to be gone
        self._next_beat = 0
        self._idle: bool | None = None  # what the idle set says of us (None: not said yet)
        self.shown_reading: str | None = None  # the read in progress the worker hash names (None: not said yet)
        self.shown_affinity: tuple[list[str], str] | None = None  # the prefixes and memory wait it names

    def due(self, now: int) -> bool:
        return now >= self._next_beat

    def run(self, now: int, state: WorkerState) -> None:
        """One heartbeat's work; the next is due heartbeat_ms later."""
        back = self.claims.requeue_expired(now)
        if back:
            log.warning("took back %d requests whose worker stopped renewing: %s", len(back), back)
        back = self.claims.reclaim_from_dead(self.is_dead, now)
        if back:
            log.warning("took back %d requests of a dead worker on this host: %s", len(back), back)
        self.membership.forget_dead(self.is_dead)
        gone = self.claims.expire_overdue(now)
        if gone:
            log.info("%d requests waited past their queue_timeout and expired: %s", len(gone), gone)
        self.publish(state, now)
        if self._idle:
            self.membership.set_idle(True, now)  # still idle: keep the entry fresh
        self._next_beat = now + self.heartbeat_ms

    def publish(self, state: WorkerState, now: int) -> None:
        """The worker hash, with a TTL of a few heartbeats: a dead worker's hash goes by itself."""
        self.membership.heartbeat(state, now, ttl_s=max(3, 5 * self.heartbeat_ms // 1000))
        self.shown_reading = state.reading
        self.shown_affinity = (state.prefixes, state.waits_for_memory)

    def note_idle(self, idle: bool, now: int) -> None:
        """Say whether a newcomer can land here (workers/scheduler.py `is_idle`), when it changes."""
        if idle != self._idle:
            self._idle = idle
            self.membership.set_idle(idle, now)

    def idle_elsewhere(self, now: int) -> bool:
        """Another live worker (heard from within three heartbeats) could take a newcomer now."""
        return self.membership.idle_elsewhere(now, within_ms=3 * self.heartbeat_ms)

    def peers(self, now: int) -> list[Peer]:
        """The other workers idle_elsewhere counts, with the prefixes they advertise."""
        return self.membership.peers(now, within_ms=3 * self.heartbeat_ms)

    def redis_lost(self) -> None:
        """Redis went away: once it is back, say the idle signal again and beat at once."""
        self._idle = None
        self.shown_reading = None
        self.shown_affinity = None
        self._next_beat = 0


def reading(current: Slot | None) -> str:
    """The request whose read is in progress (the worker hash's `reading`): the lines' slot while
    it still reads, "" once its read has ended and it decodes."""
    return current.request.id if current and current.request and current.phase is Phase.READING else ""


def describe(slots: Sequence[Slot], current: Slot | None, *, device: str, ctx: int, steps: int,
             give_ways: int, decode_path: DecodePath = DecodePath(), prompt_tokens_read: int = 0,
             pool: BlockPool | None = None, waits: Admission = Admission(),
             prefixes: Sequence[str] = ()) -> WorkerState:
    """The worker hash an operator reads with HGETALL."""
    read = current if reading(current) else None
    blocks = {}
    if pool is not None:
        blocks = dict(kv_block=pool.block_size, blocks_total=pool.num_blocks, blocks_free=pool.num_free,
                      blocks_used=pool.num_used, blocks_cached=pool.num_cached, blocks_shared=pool.num_shared)
    waiting = getattr(waits.waits, "id", "")
    return WorkerState(
        device=device,
        pid=os.getpid(),
        ctx=ctx,
        slots_total=len(slots),
        slots_busy=sum(not s.is_free for s in slots),
        steps=steps,
        give_ways=give_ways,
        prompt_tokens_read=prompt_tokens_read,
        reading=read.request.id if read else "",
        reading_priority=read.priority if read else None,
        reading_prompt_tokens=len(read.tokens) if read else 0,
        reading_progress=read.read_pos if read else 0,
        reading_yields=read.yields if read else 0,
        parked=[s.request.id for s in slots if s.is_parked],
        reserved={s.index: s.min_priority for s in slots if s.is_reserved},
        reserved_busy=sum(s.is_reserved and not s.is_free for s in slots),
        decode_step=decode_path.kind,
        compile_progress=decode_path.percent,
        waits_for_memory=waiting,
        blocks_short=waits.blocks_short if waiting else 0,
        prefixes=list(prefixes),
        **blocks,
    )
