"""What a worker publishes about itself in its hash `strata:{m}:worker:<wid>` (short TTL), and
the one parser of it, for `strata queues` and /metrics alike."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class WorkerState:
    device: str = ""
    pid: int = 0  # its process on its host: how `strata serve` knows its own workers, whatever their ids
    ctx: int = 0  # tokens per slot (prompt + answer): what fits on this worker
    slots_total: int = 0
    slots_busy: int = 0
    steps: int = 0
    give_ways: int = 0
    prompt_tokens_read: int = 0  # prompt tokens this worker's reads fed the engine (n answers read theirs once)
    reading: str = ""  # the request whose prompt holds the lines now
    reading_priority: int | None = None
    reading_prompt_tokens: int = 0
    reading_progress: int = 0
    reading_yields: int = 0
    parked: list[str] = field(default_factory=list)  # reads that gave way, their cache kept
    reserved: dict[int, int] = field(default_factory=dict)  # slot -> lowest priority it takes (--reserve)
    reserved_busy: int = 0
    # how its decode steps run: eager | compiling (eager while the compiled step is built in the
    # background; compile_progress: an estimate in percent) | compiled
    decode_step: str = ""
    compile_progress: int = 0
    # its KV pool (workers/blocks.py), in blocks of kv_block tokens: free = what admission may
    # still promise; used = held by a slot; cached = keyed prefix blocks a new prompt may reuse
    # (held or not); shared = held by two slots or more
    kv_block: int = 0
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_used: int = 0
    blocks_cached: int = 0
    blocks_shared: int = 0
    waits_for_memory: str = ""  # the head a free slot would take, held back until the pool has room
    blocks_short: int = 0  # ... and how many more free blocks it needs
    # the affinity keys (queues/affinity.py) of the prompt prefixes it holds, newest first, at most
    # workers/affinity.py ADVERTISED: in a slot now, or cached in its KV pool. Another worker with a
    # free slot leaves it a newcomer with one of these keys for a moment (docs/scheduling.md)
    prefixes: list[str] = field(default_factory=list)
    heartbeat_ms: int = 0

    def to_hash(self) -> dict[str, str | int]:
        """Flat fields for HSET; heartbeat_ms is added by the heartbeat itself."""
        out: dict[str, str | int] = {}
        for name, value in asdict(self).items():
            if name == "heartbeat_ms" or (name.startswith("reading_") and not self.reading):
                continue
            if name == "blocks_short" and not self.waits_for_memory:
                continue
            if isinstance(value, dict):
                value = ",".join(f"{slot}:{floor}" for slot, floor in sorted(value.items()))
            out[name] = ",".join(value) if isinstance(value, list) else value
        return out

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> "WorkerState":
        """Tolerant: a field missing or garbled reads as its default (an operator may HSET)."""
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = h.get(f.name)
            if raw in (None, ""):
                continue
            if f.name in ("parked", "prefixes"):
                values[f.name] = [p for p in raw.split(",") if p]
            elif f.name == "reserved":
                values[f.name] = _reserved(raw)
            elif f.name in ("device", "reading", "decode_step", "waits_for_memory"):
                values[f.name] = raw
            else:
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    continue
        return cls(**values)


    def decode_step_words(self) -> str:
        """What its decode step is doing, for /health and `strata queues`."""
        if self.decode_step == "compiling":
            return f"compiling the decode step, serving eager meanwhile: {self.compile_progress} %"
        return {"compiled": "decoding with the compiled step", "eager": "decoding eagerly"}.get(self.decode_step, "")


def _reserved(raw: str) -> dict[int, int]:
    """`2:5,3:10` (slot:min priority); a garbled pair is skipped."""
    out: dict[int, int] = {}
    for pair in raw.split(","):
        slot, _, floor = pair.partition(":")
        try:
            out[int(slot)] = int(floor)
        except ValueError:
            continue
    return out
