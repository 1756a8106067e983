"""Admission by memory, as a pure decision beside workers/scheduler.py: no Redis, torch or clock.

A request is admitted only when the KV pool can promise it everything it may use (its prompt plus
its max_tokens, less the cached prefix blocks it shares with running slots: BlockPool.blocks_needed),
because a decode is never paused to make room (rule 5). On top of the scheduling rules:

- The request rule 2 (and rule 10's reserved slots, and aging) would give a free slot to is the
  only candidate. If the pool cannot hold it now, nobody is admitted on this worker: the head
  waits for memory and nothing behind it, of any priority, takes the memory it waits for.
  The bound on overtaking is therefore zero: no smaller request overtakes a waiter for memory.
  (The memory comes as running requests finish; each ends within its own max_tokens, so the
  head's wait is bounded by the longest remaining answer of what runs now.)
- When every request fits, the decision is pick_waiting's, exactly.
- A request that could never fit is refused, not queued: its prompt leaving no room in the
  model's context, or prompt plus max_tokens beyond the context or the whole pool (never_fits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence

from workers.scheduler import Policy, W, pick_waiting
from workers.slot import Slot


@dataclass(frozen=True)
class Admission(Generic[W]):
    """What to do with the waiting queue now: admit `take`, or let `waits` wait at the head for
    `blocks_short` more free blocks (what `strata queues` shows), or neither (no free slot for
    anyone, or nobody waiting)."""

    take: W | None = None
    waits: W | None = None
    blocks_short: int = 0


def admit(
    slots: Sequence[Slot],
    waiting: Sequence[W],
    policy: Policy,
    blocks_needed: Callable[[W], int],
    num_free: int,
) -> Admission[W]:
    """The request a free slot takes now, given the pool's free blocks and what each would take."""
    pick = pick_waiting(slots, waiting, policy)
    if pick is None:
        return Admission()
    need = blocks_needed(pick)
    if need <= num_free:
        return Admission(take=pick)
    return Admission(waits=pick, blocks_short=need - num_free)


def never_fits(prompt_tokens: int, max_tokens: int, max_model_len: int, pool_tokens: int) -> str | None:
    """Why this request can never be served here (the 400 at the door names both numbers), or
    None. `max_tokens` is the answer length as planned at the door, which (as today's context
    check, shapes/rules.py `max_tokens`) lowers what was asked to the room the context leaves; so
    a prompt is refused only when it leaves no room, and prompt + answer when the whole pool could
    not hold it. A request that fits only when the pool is empty is not refused: it waits its turn."""
    if prompt_tokens >= max_model_len:
        return (
            f"This model's context is {max_model_len} tokens; the prompt has {prompt_tokens},"
            f" which leaves no room for an answer."
        )
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        return (
            f"This model's context is {max_model_len} tokens; the prompt ({prompt_tokens})"
            f" plus max_tokens ({max_tokens}) is {total}."
        )
    if total > pool_tokens:
        return (
            f"The KV pool holds {pool_tokens} tokens; the prompt ({prompt_tokens})"
            f" plus max_tokens ({max_tokens}) is {total}."
        )
    return None


def admit_in_order(picks: Sequence[W], blocks_needed: Callable[[W], int], num_free: int) -> tuple[list[W], Admission[W]]:
    """Of one step's picks (scheduler.pick_many: service order, each with a free slot), those the
    pool can promise everything they may use, one after another: up to the first that does not
    fit, which waits at the head `blocks_short` blocks short while nobody behind it is admitted
    (the bound on overtaking stays zero). Each admitted pick's blocks count as taken for the next."""
    taken: list[W] = []
    for pick in picks:
        need = blocks_needed(pick)
        if need > num_free:
            return taken, Admission(waits=pick, blocks_short=need - num_free)
        taken.append(pick)
        num_free -= need
    return taken, Admission()
