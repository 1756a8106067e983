"""`strata queues`: per model, the waiting requests in service order, each worker's slots and
current read, and the parked reads. `--watch` refreshes it."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from queues.connect import connect
from queues.inspect import ModelView, snapshot
from queues.server import recorded_url
from queues.worker_state import WorkerState


def find_redis(redis_url: str | None, data_dir: Path) -> str:
    """The same Redis `strata serve` uses: REDIS_URL, else the embedded one's recorded address."""
    url = redis_url or recorded_url(data_dir)
    if not url:
        raise SystemExit(f"no REDIS_URL and no running `strata serve` recorded in {data_dir.resolve()}")
    return url


def render(views: list[ModelView]) -> Group:
    parts = []
    if not views:
        parts.append(Table(title="no model has a worker yet"))
    for view in views:
        waiting = Table(title=f"{view.name}: {view.waiting_total} waiting, {view.running} running", title_justify="left")
        for column in ("#", "request", "priority", "age", "prompt tokens", "key"):
            waiting.add_column(column)
        for place, w in enumerate(view.waiting, 1):
            waiting.add_row(str(place), w.id, str(w.priority), f"{w.age_s:.1f}s", str(w.prompt_tokens), w.key_name or "-")
        workers = Table(title="workers", title_justify="left")
        for column in ("worker", "device", "slots", "reserved", "kv blocks", "reading", "priority", "progress", "parked",
                       "give-ways", "seen"):
            workers.add_column(column)
        for wid, w in view.workers:
            progress = f"{w.reading_progress}/{w.reading_prompt_tokens}" if w.reading else "-"
            seen_s = max(0, view.now_ms - (w.heartbeat_ms or view.now_ms)) / 1000
            reserved = " ".join(f"{slot}:>={floor}" for slot, floor in sorted(w.reserved.items()))
            reserved = f"{w.reserved_busy}/{len(w.reserved)} ({reserved})" if w.reserved else "-"
            workers.add_row(wid, w.device, f"{w.slots_busy}/{w.slots_total}", reserved, kv_blocks(w), w.reading or "-",
                            "-" if w.reading_priority is None else str(w.reading_priority), progress,
                            ",".join(w.parked) or "-", str(w.give_ways), f"{seen_s:.1f}s ago")
        parts += [waiting, workers]
    return Group(*parts)


def kv_blocks(w: WorkerState) -> str:
    """The pool in a cell: free/total, cached and shared, and what the head waits for."""
    if not w.blocks_total:
        return "-"
    cell = f"{w.blocks_free}/{w.blocks_total} free, {w.blocks_cached} cached, {w.blocks_shared} shared"
    if w.waits_for_memory:
        cell += f"; {w.waits_for_memory} waits for {w.blocks_short} more"
    return cell


def show(redis_url: str | None, data_dir: Path, *, watch: bool, interval_s: float, limit: int,
         cluster: bool = False, console: Console | None = None) -> None:
    client = connect(find_redis(redis_url, data_dir), cluster=cluster, within_s=0)
    console = console or Console()

    def frame() -> Group:
        return render(snapshot(client, int(time.time() * 1000), limit))

    if not watch:
        console.print(frame())
        return
    with Live(frame(), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(frame())
        except KeyboardInterrupt:
            pass
