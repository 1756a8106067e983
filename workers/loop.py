"""The worker loop: admit into free slots, advance one read by a chunk (the lines), decode all
decoding slots together, report the step to Redis, finish what ended. Decisions come from
workers/scheduler.py; what becomes of a sampled token is workers/acceptance.py; the fleet's
upkeep once a heartbeat is workers/upkeep.py. This file carries them out, and keeps one
request's failure, or Redis going away, from taking the worker down."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from engine.errors import RequestError, RowsFailed
from engine.protocol import Engine, SamplingParams
from queues.claims import UNAVAILABLE, Claimed, Claims, Ending, Held, Resumed, Verdict, Waiting
from queues.lifecycle import RequestStatus
from queues.membership import Membership
from queues.records import Done, Event, Failed, QueuedRequest, Token
from queues.worker_state import WorkerState
from workers import admission, scheduler
from workers.acceptance import accept
from workers.affinity import HeldPrefixes
from workers.kv_pool import KvPool
from workers.slot import Phase, Slot
from workers.text import Decoder, TextStream, scored
from workers.upkeep import Upkeep, describe, reading

log = logging.getLogger("strata.worker")


def wall_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class StepOutput:
    """What one step did, for its report: by request id, what the report carries for it."""

    held: dict[str, Held] = field(default_factory=dict)
    ended: list[tuple[Slot, Event, RequestStatus]] = field(default_factory=list)  # slot, last event, status

    def of(self, slot: Slot) -> Held:
        request = slot.request
        if request.id not in self.held:
            self.held[request.id] = Held(request.id, slot.claim_seq, request.priority, slot.generated)
        return self.held[request.id]


def engine_failure(error: Exception, doing: str = "engine error") -> Failed:
    """The end event of a request the engine failed: a RequestError with its own code and words
    (the request's input was the cause: a 400 at the API), anything else an engine error."""
    if isinstance(error, RequestError):
        return Failed(str(error), error.code)
    return Failed(f"{doing}: {error}")


class NeverFits(Exception):
    """The request could never be held here (its prompt and answer beyond the context or the
    whole KV pool): it fails at once instead of waiting at the head for memory that never comes."""


class SlotFailed(Exception):
    """An error no targeted handler expected, raised while working on one slot: the step gives
    that slot's claim back as lost (and the others' cleanly)."""

    def __init__(self, slot: Slot) -> None:
        super().__init__(f"slot {slot.index} ({slot.request.id if slot.request else 'free'})")
        self.slot = slot


@contextmanager
def blamed_on(slot: Slot) -> Iterator[None]:
    """Whatever breaks in here is about `slot`; Redis going away is about no one."""
    try:
        yield
    except (SlotFailed, *UNAVAILABLE):
        raise
    except Exception as error:  # noqa: BLE001 - re-raised, naming its slot
        raise SlotFailed(slot) from error


class Worker:
    def __init__(
        self,
        engine: Engine,
        claims: Claims,
        decoder: Decoder,
        *,
        prefill_chunk: int,
        policy: scheduler.Policy = scheduler.Policy(),
        device: str = "cpu",
        heartbeat_ms: int = 1000,
        idle_wait_s: float = 0.5,
        clock: Callable[[], int] = wall_ms,
        is_dead: Callable[[str], bool] = lambda _worker_id: False,
        membership: Membership | None = None,
    ) -> None:
        self.engine = engine
        self.claims = claims
        self.membership = membership or Membership(claims.client, claims.model, claims.worker_id)
        self.decoder = decoder
        # Reads start and stop on the engine's prompt blocks, so a prompt token is computed the same
        # way whether it was read cold, after a cached prefix or after giving way (engine/protocol.py)
        block = getattr(engine, "prompt_block", 1)
        self.prefill_chunk = -(-prefill_chunk // block) * block
        self.policy = policy
        self.device = device
        self.idle_wait_s = idle_wait_s
        self.clock = clock
        self.upkeep = Upkeep(claims, self.membership, heartbeat_ms=heartbeat_ms, is_dead=is_dead)
        floors = scheduler.slot_floors(engine.num_slots, policy.reserve)
        self.slots = [Slot(i, min_priority=floor) for i, floor in enumerate(floors)]
        self.steps = 0
        self.give_ways = 0
        self.prompt_tokens_read = 0  # through engine.read, since start (the worker hash's prompt_tokens_read)
        self.stopping = False
        self.current: Slot | None = None  # the read that holds the lines
        # the KV pool (workers/kv_pool.py) when the engine pages its cache; None: each slot's own
        self.pool = KvPool(engine) if getattr(engine, "kv_tokens", None) else None  # type: ignore[arg-type]
        self.waits_for_memory: admission.Admission = admission.Admission()  # the head this worker holds back
        self.redis_up = True
        self._dropped: list[tuple[str, int]] = []  # claims let go while Redis was away: handed back once it is back
        # tokens of the answers already ended of a request of n that still runs (their slots are free)
        self._ended_tokens: dict[str, int] = {}
        self.prefixes = HeldPrefixes()  # the prompt prefixes held here, advertised in the worker hash
        self._left: dict[str, int] = {}  # member -> when this worker first left it to a worker holding its prefix

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        log.info("worker %s serving %d slots", self.claims.worker_id, len(self.slots))
        try:
            self.announce(self.clock())
        except UNAVAILABLE as error:
            log.warning("could not publish the aging policy (%s); enqueues score by what Redis holds", error)
        try:
            while not self.stopping:
                if not self.turn():
                    self._wait()
        finally:
            self.stop()

    def announce(self, now: int) -> None:
        """The queue's order is the workers' policy: publish --aging-s for enqueue.lua."""
        before = self.membership.set_aging(self.policy.aging_s, now)
        if before is not None and before != self.policy.aging_s:
            log.warning("aging %s s -> %s for every new request of this model (another worker had set it); "
                        "requests already waiting keep their places", before, self.policy.aging_s)

    def turn(self) -> bool:
        """A step that survives Redis going away, and anything else: no request takes the worker
        down. False when there was nothing to do."""
        try:
            busy = self.step()
            self.redis_up = True
            return busy
        except UNAVAILABLE as error:
            self.forget(error)
            return False
        except SlotFailed as failed:
            log.exception("step failed at %s; giving back the requests it held", failed)
            self._abandon(failed.slot)
            return False
        except Exception:  # noqa: BLE001 - a bug the targeted handlers did not catch, about no one slot
            log.exception("step failed; giving back the requests it held, all as suspects")
            self._abandon(None)
            return False

    def _abandon(self, culprit: Slot | None) -> None:
        """Give back every claim; the culprit's (everyone's when it is unknown) counts as lost, so
        a request that keeps breaking steps fails after max_attempts (requeue.lua) instead of
        taking worker after worker down."""
        held = self._claims_held()
        suspects = held if culprit is None else [(culprit.request.id, culprit.claim_seq)] if culprit.request else []
        try:
            now = self.clock()
            self.claims.give_back(suspects, now, lost=True)
            self.claims.give_back([c for c in held if c not in suspects], now)
        except UNAVAILABLE:
            pass  # their leases run out instead
        self._release_all()

    def _claims_held(self) -> list[tuple[str, int]]:
        """(request id, claim_seq) of each request held, once however many answers' slots it holds."""
        return list(dict.fromkeys((s.request.id, s.claim_seq) for s in self.slots if s.request))

    def _siblings(self, slot: Slot) -> list[Slot]:
        """The slots holding the answers of this slot's request (itself included). Asked for every
        decoding slot each step (`_generated`): a request of one answer is its own slot, no scan."""
        if slot.request is not None and slot.request.n == 1:
            return [slot]
        return [s for s in self.slots if s.request is not None and s.request.id == slot.request.id
                and s.claim_seq == slot.claim_seq]

    def _release_all(self) -> None:
        for slot in self.slots:
            if slot.request:
                self._release(slot)
        self.current = None
        self._ended_tokens.clear()

    def _wait(self) -> None:
        """Nothing to do: block until an enqueue wakes us (or Redis is back). A request left to a
        worker holding its prefix is ours once the affinity wait is over: back by then."""
        wait_s = self.idle_wait_s
        now = self.clock()
        wakes_at = scheduler.affinity_wakes_at(self._left, now, self.policy)
        if wakes_at is not None:
            wait_s = min(wait_s, max(0.01, (wakes_at - now) / 1000))
        if self.redis_up:
            try:
                self.claims.wait_for_work(wait_s)
                return
            except UNAVAILABLE as error:
                self.forget(error)
        time.sleep(wait_s)

    def forget(self, error: Exception) -> None:
        """Redis went away mid-step: what this step produced may not have reached the clients, so
        the worker drops every request rather than guess. Redis is the truth: once it is back the
        worker hands those claims back (they go to their places in the queue), and whoever claims
        them resumes after the tokens the stream really holds."""
        if not self.redis_up:
            return
        self.redis_up = False
        self._dropped += self._claims_held()
        log.warning("Redis unavailable (%s); dropping %d requests until it is back", error, len(self._dropped))
        self._release_all()
        self.upkeep.redis_lost()

    def stop(self) -> None:
        """Hand back whatever is still running; the next worker resumes it. With Redis gone the
        leases run out instead, to the same effect."""
        active = self._claims_held()
        try:
            back = self.claims.give_back(active, self.clock())
            self.membership.leave()
            if back:
                log.info("gave back %d requests", len(back))
        except UNAVAILABLE as error:
            log.warning("could not hand back %d requests (%s); their leases will run out", len(active), error)
        self._release_all()

    def step(self) -> bool:
        """One turn of the loop; False when there was nothing to do."""
        now = self.clock()
        if self._dropped:
            back = self.claims.give_back(self._dropped, now)
            log.info("Redis is back: handed back %d of the %d requests dropped", len(back), len(self._dropped))
            self._dropped = []
        if self.upkeep.due(now):
            self.upkeep.run(now, self.describe())
        self.steps += 1
        out = StepOutput()
        self._admit(now, out)
        self._catch_up(out)
        lines = scheduler.next_read(self.slots, self.current, self.policy)
        if lines.gave_way:
            self._give_way(lines.gave_way, lines.read, out)
        self.current = lines.read
        decoding = scheduler.decoding(self.slots)  # before the read, so a slot never gets two tokens in one step
        early = Verdict(frozenset(), frozenset())
        if lines.read:
            read = self._read(lines.read, out)
            firsts = [out.held.pop(slot.request.id) for slot in read
                      if slot.request and slot.request.id in out.held and out.held[slot.request.id].first_token]
            if firsts and scheduler.first_token_early(True, decoding):
                early = self.claims.report(firsts, self.clock())
            else:
                out.held.update((h.id, h) for h in firsts)
        if decoding:
            self._decode(decoding, out)
        freed = self._settle_answers(out)
        for slot in self.slots:
            if slot.request:
                out.of(slot).generated = self._generated(slot)
        # the step's writes, tokens and ends, in one round trip (queues/claims.py report_and_finish)
        ends = self._endings(out.ended)
        verdict, ended = self.claims.report_and_finish(
            list(out.held.values()),
            [Ending(s.request.id, s.claim_seq, event, status, self._generated(s)) for s, event, status in ends],
            self.clock())
        for slot in freed:
            if slot.request:
                self._ended_tokens[slot.request.id] = self._ended_tokens.get(slot.request.id, 0) + slot.generated
                self._release(slot, list(slot.request.prompt[: self.engine.position(slot.index)]))
        for (slot, _event, status), done in zip(ends, ended):
            if slot.request:
                self._settle(slot, status, done)
        verdict = Verdict(verdict.lost | early.lost, verdict.cancelled | early.cancelled)
        for slot in self.slots:
            if slot.request and slot.request.id in verdict.lost:
                self._drop(slot)
        for slot in self.slots:
            if slot.request and slot.request.id in verdict.cancelled:
                self._finish(slot, None, RequestStatus.CANCELLED)
        # The read in progress is visible in the worker hash: published when it changes, as the
        # step ends. A short read that starts and ends within one step is never in progress
        # between steps, and costs no round trip of its own (a battery's step has several).
        # so are the prefixes it holds and a head it holds back for memory (others' affinity reads them)
        if (reading(self.current) != self.upkeep.shown_reading
                or self._affinity_shown() != self.upkeep.shown_affinity):
            self.upkeep.publish(self.describe(), now)
        self.upkeep.note_idle(scheduler.is_idle(self.slots), now)
        return bool(lines.read or decoding)

    def _catch_up(self, out: StepOutput) -> None:
        """Before the lines are given out: each prompt read takes the cached blocks another slot's
        read keyed since it was admitted (two requests with one new prefix arriving together: the
        second reads only what follows it), so the lines' rules judge what is left to read. A read
        that adopts blocks begins again from there (nothing sampled yet), its request hash's
        cached_tokens raised to match (workers/blocks.py `catch_up`)."""
        if self.pool is None:
            return
        for slot in self.slots:
            if slot.phase is not Phase.READING or slot.params is None or slot.read_pos >= len(slot.request.prompt):
                continue
            with blamed_on(slot):
                held = self.pool.catch_up(slot.index, slot.request.prompt)
                if held:
                    log.info("%s: %d more prompt tokens cached by another read; reads on from %d",
                             slot.request.id, held - slot.read_pos, held)
                    slot.read_pos = held
                    self.engine.begin(slot.index, slot.params, keep=held)
                    out.of(slot).cached_tokens = self.pool.cached_tokens(slot.index)

    def _read(self, first: Slot, out: StepOutput) -> list[Slot]:
        """The lines this step: a chunk of the read that holds them, then, while what is left of
        the chunk's token budget holds the whole of the next read in line (scheduler.next_read's
        order: rules 3 and 6), that read too, start to end. A read that does not fit whole waits
        for the next step, where the give-way rules govern it as ever. Returns the slots read."""
        read, budget, slot = [], self.prefill_chunk, first
        while slot is not None:
            with blamed_on(slot):
                budget -= self._read_chunk(slot, out, budget)
            read.append(slot)
            if slot.phase is Phase.READING:
                break  # still reading, or its read failed: the lines were its for this step
            self._catch_up(out)
            slot = scheduler.short_read(self.slots, self.policy, budget)
        return read

    @staticmethod
    def _endings(ended: list[tuple[Slot, Event, RequestStatus]]) -> list[tuple[Slot, Event, RequestStatus]]:
        """The requests that ended this step, each once (two answers of one may fail in one step)."""
        seen: dict[tuple[str, int], tuple[Slot, Event, RequestStatus]] = {}
        for slot, event, status in ended:
            if slot.request is not None:
                seen.setdefault((slot.request.id, slot.claim_seq), (slot, event, status))
        return list(seen.values())

    def _settle_answers(self, out: StepOutput) -> list[Slot]:
        """A request of n answers ends with its last one. An answer that ends before it (its
        siblings still decoding) goes out as its own Done in this step's report, and its slot is
        freed after it (returned): the request's end is its last answer's."""
        freed: list[Slot] = []
        ended = []
        for slot, event, status in out.ended:
            if (status is RequestStatus.FINISHED and slot.request is not None
                    and any(s is not slot and all(s is not f for f in freed) for s in self._siblings(slot))):
                out.of(slot).tokens.append(event)
                freed.append(slot)
            else:
                ended.append((slot, event, status))
        out.ended = ended
        return freed

    def _generated(self, slot: Slot) -> int:
        """Tokens its request produced so far: all its answers', earlier attempts included."""
        return sum(s.generated for s in self._siblings(slot)) + self._ended_tokens.get(slot.request.id, 0)

    def _affinity_shown(self) -> tuple[list[str], str]:
        """What the worker hash should say for other workers' prefix affinity."""
        return (self.prefixes.held(self.slots, self.pool.blocks if self.pool else None),
                getattr(self.waits_for_memory.waits, "id", ""))

    def describe(self) -> WorkerState:
        """The worker hash an operator reads with HGETALL (workers/upkeep.py `describe`). Between
        steps: a compiled step built in the background may take over here (`decode_path`)."""
        return describe(self.slots, self.current, device=self.device, ctx=self.engine.ctx, steps=self.steps,
                        give_ways=self.give_ways, decode_path=self.engine.decode_path(),
                        prompt_tokens_read=self.prompt_tokens_read,
                        pool=self.pool.blocks if self.pool else None, waits=self.waits_for_memory,
                        prefixes=self.prefixes.held(self.slots, self.pool.blocks if self.pool else None))

    # -- the parts --------------------------------------------------------------------------
    def _admit(self, now: int, out: StepOutput) -> None:
        """Fill the free slots from the head of the queue: the step's picks (scheduler.pick_many)
        claimed in one round trip; again while a claim went to another worker first. With a KV
        pool, only those it can promise their memory (`_fitting`)."""
        self.waits_for_memory = admission.Admission()
        while not self.stopping and any(s.is_free for s in self.slots):
            head = self.claims.head(sum(s.is_free for s in self.slots))
            self._left = {w.member: self._left[w.member] for w in head if w.member in self._left}
            picks = scheduler.pick_many(self.slots, head, self.policy)
            if not picks and scheduler.look_further(head, self.policy):
                picks = scheduler.pick_many(self.slots, self.claims.head(scheduler.RESERVED_LOOKAHEAD), self.policy)
            if not picks:
                return
            lines_busy = not scheduler.lines_free(self.slots)
            held = self._held_for(picks)
            # another worker is asked about (a round trip) only when a pick would wait for the lines
            # here, or when the first pick's prefix may be held elsewhere (then with what each advertises)
            peers = self.upkeep.peers(now) if held is not None else None
            idle = bool(peers) if peers is not None else (lines_busy or len(picks) > 1) and self.upkeep.idle_elsewhere(now)
            picks = [p for i, p in enumerate(picks) if scheduler.admit_here(lines_busy or i > 0, idle)]
            if not picks:
                return  # an idle worker takes it: nobody here gives way or waits for the lines
            if peers:
                before = picks
                picks, holder = scheduler.leave_for_prefix(picks, held or (), peers, self._left, now, self.policy)
                if holder is not None:
                    self._leave(before[len(picks)], holder, now)
                if not picks:
                    return  # the worker holding its prefix takes it (at most affinity_wait_s from now)
            if self.pool is not None:
                picks = self._fitting(picks)
                if not picks:
                    return  # the head waits for memory, and nobody behind it takes that memory
            claimed = self.claims.claim_many(picks, now)
            for each in claimed:
                if each is not None:
                    self._take_slots(each, out)
                    self.prefixes.note(each.request, self.pool.blocks if self.pool else None)
            if all(each is not None for each in claimed):
                return

    def _held_for(self, picks: list[Waiting]) -> list[str] | None:
        """The prefixes held here, when the first pick's may be held elsewhere instead (it has an
        affinity key this worker does not hold, and affinity is on); None otherwise."""
        key = picks[0].affinity if picks else None
        if not key or self.policy.affinity_wait_s <= 0:
            return None
        held = self.prefixes.held(self.slots, self.pool.blocks if self.pool else None)
        return None if key in held else held

    def _leave(self, left: Waiting, holder: str, now: int) -> None:
        """`left` is left to `holder`, which holds its prefix: it is woken the first time, and the
        wait is counted from then."""
        if left.member not in self._left:
            self._left[left.member] = now
            log.info("%s: leaving it to %s, which holds its prompt's prefix (for %.2f s at most)",
                     left.id, holder, self.policy.affinity_wait_s)
            self.membership.wake(holder)

    def _fitting(self, picks: list[Waiting]) -> list[Waiting]:
        """Admission by memory (workers/admission.py): the picks the pool can promise all they may
        use, in order; the first that does not fit waits at the head (`waits_for_memory`). One
        that could never fit goes through, to fail at `_start`; one gone meanwhile, to its claim."""
        assert self.pool is not None
        pool = self.pool
        requests = {pick.id: self.claims.waiting_request(pick) for pick in picks}

        def need(pick: Waiting) -> int:
            request = requests[pick.id]
            if request is None or pool.never_fits(request.prompt, request.max_tokens):
                return 0
            return pool.blocks_needed(request.prompt, request.max_tokens, request.n)

        taken, self.waits_for_memory = admission.admit_in_order(picks, need, pool.blocks.num_free)
        return taken

    def _take_slots(self, claimed: Claimed, out: StepOutput) -> None:
        request = claimed.request
        taken: list[Slot] = []
        for _ in range(request.n):  # one slot per answer, the first (best cached prefix) reads
            slot = scheduler.free_slot(self.slots, request.prompt, self.policy, request.priority)
            if slot is None:  # cannot be: pick_many counted its slots free, and no one else takes slots
                raise RuntimeError(f"no free slot for {request.id} (priority {request.priority}, n {request.n})")
            slot.phase = Phase.AWAITING_READ  # taken: the next free_slot looks past it
            taken.append(slot)
        with blamed_on(taken[0]):
            self._start(taken, claimed, out)

    def _give_way(self, parked: Slot, to: Slot, out: StepOutput) -> None:
        parked.yields += 1
        parked.gave_way_to = to.request.id
        self.give_ways += 1
        out.of(parked).gave_way_to = to.request.id
        log.info("%s (priority %d, %d/%d read) gives way to %s (priority %d, %d tokens)",
                 parked.request.id, parked.priority, parked.read_pos, len(parked.tokens),
                 to.request.id, to.priority, len(to.tokens))

    def _finish(self, slot: Slot, event: Event | None, status: RequestStatus) -> None:
        done = self.claims.finish(slot.request.id, slot.claim_seq, event, status, self._generated(slot), self.clock())
        self._settle(slot, status, done)

    def _settle(self, slot: Slot, status: RequestStatus, done: bool) -> None:
        """After finish: free the slots of the request's answers (`done`: it ended; else this
        worker had lost the claim and writes nothing more)."""
        request = slot.request
        siblings = self._siblings(slot)
        if not done:
            log.warning("%s: claim %d was lost before it ended (lease ran out); nothing written",
                        request.id, slot.claim_seq)
            for sibling in siblings:
                self._drop(sibling)
            return
        self._ended_tokens.pop(request.id, None)
        for sibling in siblings:  # the request's end is every answer's: a failure or cancel ends them all
            cached = None
            if status is RequestStatus.FINISHED:  # a later prompt may keep the prompt's entries, not the
                # answer's: those came from decode steps, and a prompt read cold would not match them
                cached = list(request.prompt[: self.engine.position(sibling.index)])
            self._release(sibling, cached)

    def _drop(self, slot: Slot) -> None:
        """This worker lost the claim (it froze past its lease): another worker has the request
        or will. Free the slot at once and write nothing more about it."""
        log.warning("%s: lost claim %d (lease ran out); dropping it, writing nothing more",
                    slot.request.id, slot.claim_seq)
        self._ended_tokens.pop(slot.request.id, None)
        self._release(slot)

    def _release(self, slot: Slot, cached: list[int] | None = None) -> None:
        if slot is self.current:
            self.current = None
        if self.pool is not None:
            self.pool.free(slot.index)  # its prefix blocks stay cached for whoever comes next
            cached = None
        slot.release(self.steps, cached)

    def _start(self, slots: list[Slot], claimed: Claimed, out: StepOutput) -> None:
        """The request into its slots: the first reads the prompt, the others (n > 1) wait for
        that read and take a copy of its cache (engine.fork, at the read's end: `_read_chunk`).
        Resumed after some of its n answers streamed (its worker died), each answer goes on from
        its own place instead: it reads the prompt and replays its own answer in its own slot (no
        fork: the caches part after the prompt), and an answer that had ended frees its slot."""
        request = claimed.request
        resumed = self.claims.resumed(request.id, request.n) if claimed.attempts > 1 else None
        answers = resumed or [Resumed([], "")] * request.n
        apart = request.n > 1 and any(a.token_ids or a.text for a in answers)
        for choice, each in enumerate(slots):
            each.request = request
            each.claim_seq = claimed.claim_seq
            each.choice = choice
            each.tokens = list(request.prompt) + answers[choice].token_ids
            each.generated = len(answers[choice].token_ids)
        for each in [s for s in slots if answers[s.choice].ended]:  # its Done is in the stream already
            self._ended_tokens[request.id] = self._ended_tokens.get(request.id, 0) + each.generated
            each.release(self.steps)
        slots = [s for s in slots if s.request is not None]
        if not slots:
            raise RuntimeError(f"{request.id}: claimed again with every answer ended")
        readers = slots if apart else slots[:1]
        slot = slots[0]
        # what the slot's cache already holds of the prompt, to the last whole block; prompt
        # scoring reads every position itself
        scoring = request.prompt_logprobs is not None
        block = getattr(self.engine, "prompt_block", 1)
        # a recurrent model's state cannot be cut back to a shared prefix (engine/runner.py `rewinds`)
        reuses = not scoring and getattr(self.engine, "rewinds", True)
        for each in readers:
            each.read_pos = scheduler.shared_prefix(each.cached, request.prompt) // block * block if reuses else 0
            each.phase = Phase.READING
        out.of(slot).slot = slot.index
        try:
            if self.pool is not None:
                reason = self.pool.never_fits(request.prompt, request.max_tokens)
                if reason:
                    raise NeverFits(reason)
                for each in slots:  # the others' reservations only: they share the read's blocks at the fork
                    cached = self.pool.start(each.index, request.prompt, request.max_tokens, request.priority,
                                             use_cache=reuses and each in readers)
                    if each in readers:
                        each.read_pos = cached
                        if each is slot:
                            out.of(slot).cached_tokens = cached
            for each in slots:
                done = answers[each.choice]
                each.text = TextStream(self.decoder, request.stop, done.token_ids, done.text)
                # the prompt's scores go with the echo of the answer that reads it (one read, or
                # each answer of a resumed request that has not streamed its echo yet)
                echoes = each is slot if not apart else not done.token_ids
                each.params = self._params(request, each.choice, done.token_ids, echoes)
                self.engine.begin(each.index, each.params, keep=each.read_pos if each in readers else 0)
        except NeverFits as error:
            log.warning("%s can never fit here: %s", request.id, error)
            out.held.pop(request.id, None)
            self._finish(slot, Failed(str(error), "context_length_exceeded"), RequestStatus.FAILED)
            return
        except Exception as error:  # noqa: BLE001 - one bad request must not take the worker down
            log.exception("could not start %s", request.id)
            out.held.pop(request.id, None)
            self._finish(slot, engine_failure(error, "could not start the request"), RequestStatus.FAILED)
            return
        resumed_after = sum(len(a.token_ids) for a in answers)
        log.info("slot %d <- %s (priority %d, %d tokens, %d cached%s%s)", slot.index, request.id, request.priority,
                 len(slot.tokens), slot.read_pos, f", resumed after {resumed_after}" if resumed_after else "",
                 f", answers {request.n} in slots {[s.index for s in slots]}" if request.n > 1 else "")

    @staticmethod
    def _params(request: QueuedRequest, choice: int, done_ids: list[int], echoes: bool) -> SamplingParams:
        """Answer `choice`'s sampling: the request's, with its own seed (QueuedRequest.choice_seed);
        `echoes`: its read scores the prompt (params.prompt_logprobs)."""
        return SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.choice_seed(choice),
            min_tokens=max(0, request.min_tokens - len(done_ids)),
            already_sampled=len(done_ids),  # a seeded stream goes on where it was
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=tuple((int(t), float(b)) for t, b in request.logit_bias),
            grammar=request.grammar,
            grammar_after=request.grammar_after,
            grammar_done=tuple(done_ids) if request.grammar else (),
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs if echoes else None,
        )

    def _read_chunk(self, slot: Slot, out: StepOutput, budget: int) -> int:
        """Up to `budget` tokens of the slot's read; returns how many were read."""
        if len(slot.tokens) >= self.engine.ctx:
            out.ended.append((slot, Failed("prompt does not fit the context", "context_length_exceeded"),
                              RequestStatus.FAILED))
            return 0
        # Prompt tokens are read; a resumed request's generated tokens are replayed as the decode
        # steps fed them, so its answer goes on exactly as the undisturbed run's (docs/engine.md).
        prompt = len(slot.request.prompt)
        is_prompt = slot.read_pos < prompt
        feed = self.engine.read if is_prompt else self.engine.replay
        end = slot.read_pos + budget
        chunk = slot.tokens[slot.read_pos : min(end, prompt) if is_prompt else end]
        last = slot.read_pos + len(chunk) == len(slot.tokens)
        request = slot.request
        answers = request.max_tokens > 0  # 0: prompt scoring only (echo)
        try:
            if self.pool is not None:
                self.pool.grow(slot.index, slot.read_pos + len(chunk))
            token = feed(slot.index, chunk, sample=last and answers)
            if self.pool is not None:
                self.pool.wrote(slot.index, chunk, keyable=is_prompt)
        except Exception as error:  # noqa: BLE001 - one bad request must not take the worker down
            log.exception("read failed for %s", slot.request.id)
            out.ended.append((slot, engine_failure(error), RequestStatus.FAILED))
            return 0
        slot.read_pos += len(chunk)
        if is_prompt:
            self.prompt_tokens_read += len(chunk)
        slot.gave_way_to = None  # back on the lines: its epoch is over
        if not last:
            return len(chunk)
        out.of(slot).first_token = True
        # the answers waiting for this read (a resumed request's read their own: none)
        answers_of = [slot] + [s for s in self._siblings(slot) if s is not slot and s.phase is Phase.AWAITING_READ]
        firsts = [token]
        if answers and len(answers_of) > 1:  # n answers: the others start from a copy of this read
            try:
                if self.pool is not None:  # each sibling takes the read's full blocks as its own prefix
                    for sibling in answers_of[1:]:
                        self.pool.share_read(sibling.index, slot.index, request.max_tokens, request.priority)
                firsts += self.engine.fork(slot.index, [s.index for s in answers_of[1:]])
                if self.pool is not None:
                    for sibling in answers_of[1:]:
                        self.pool.copied(sibling.index, slot.index)
            except Exception as error:  # noqa: BLE001 - one bad request must not take the worker down
                log.exception("fork failed for %s", request.id)
                out.ended.append((slot, engine_failure(error), RequestStatus.FAILED))
                return len(chunk)
        echoed = self._echo(slot) if request.echo and slot.generated == 0 else None  # a resumed answer sent it already
        for each, first in zip(answers_of, firsts):
            each.phase = Phase.DECODING
            each.read_pos = slot.read_pos
            if echoed is not None:
                out.of(each).tokens.append(replace(echoed, choice=each.choice))
            if answers:
                self._take(each, [first], out)
            else:
                out.ended.append((each, Done("length", len(request.prompt), 0, each.choice), RequestStatus.FINISHED))
        return len(chunk)

    def _echo(self, slot: Slot) -> Token:
        """The prompt's text as the answer's start, with its tokens' logprobs when asked (the
        first has none: nothing comes before it), as one token event of no answer tokens."""
        prompt = slot.request.prompt
        shown = []
        if slot.request.prompt_logprobs is not None:
            entries = self.engine.prompt_logprobs(slot.index)[: len(prompt) - 1]
            shown = [scored(self.decoder, None, prompt[0])]
            shown += [scored(self.decoder, entry, entry.token) for entry in entries]
        return Token(self.decoder.decode(prompt), [], prompt_logprobs=shown)

    def _decode(self, slots: list[Slot], out: StepOutput) -> None:
        try:
            if self.pool is not None:
                for slot in slots:
                    self.pool.grow_for_decode(slot.index)
            tokens = self.engine.decode([s.index for s in slots], [s.last_token for s in slots])
        except RowsFailed as partly:  # some requests' own input failed them (a grammar): only those end
            for slot in slots:
                if slot.index in partly.failed:
                    log.warning("%s failed in its decode step: %s", slot.request.id, partly.failed[slot.index])
                    out.ended.append((slot, engine_failure(partly.failed[slot.index]), RequestStatus.FAILED))
            slots = [slot for slot in slots if slot.index in partly.tokens]
            tokens = [partly.tokens[slot.index] for slot in slots]
        except Exception as error:  # noqa: BLE001
            log.exception("decode step failed")
            for slot in slots:
                out.ended.append((slot, Failed(f"engine error: {error}"), RequestStatus.FAILED))
            return
        if self.pool is not None:  # each row's entries: the token it fed, then the guesses it kept
            for slot, new in zip(slots, tokens):
                self.pool.wrote(slot.index, [slot.last_token, *new[:-1]], keyable=False)
        for slot, new in zip(slots, tokens):
            try:
                self._take(slot, new, out)
            except Exception as error:  # noqa: BLE001 - e.g. its stop strings or text: this request only
                log.exception("could not take tokens %s for %s", new, slot.request.id)
                out.ended.append((slot, Failed(f"engine error: {error}"), RequestStatus.FAILED))

    def _take(self, slot: Slot, tokens: Sequence[int], out: StepOutput) -> None:
        """Tokens sampled for this slot: streamed in the step's report; the request may end."""
        logprobs = None
        if slot.request.logprobs is not None:  # the engine's entries for these tokens, in order
            logprobs = [scored(self.decoder, e, e.token) for e in self.engine.logprobs(slot.index)]
        taken = accept(slot, tokens, eos_token_ids=self.engine.eos_token_ids,
                       context_full=self.engine.position(slot.index) >= self.engine.ctx, logprobs=logprobs)
        if taken.events:
            out.of(slot).tokens.extend(taken.events)
        if taken.done:
            out.ended.append((slot, taken.done, RequestStatus.FINISHED))
