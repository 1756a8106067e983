"""What a simulation says, per priority: time to first token and time in the queue (p50, p90,
p99, max), requests served, shed (429) and expired (queue_timeout), give-ways; and for the whole
fleet: throughput and slot utilisation. As numbers (JSON) and as a rich table; `--compare`
puts two runs side by side."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rich.table import Table

from simulate.fleet import Outcome

PERCENTILES = (50, 90, 99)


def spread(values_ms: list[int]) -> dict[str, float | None]:
    """p50, p90, p99 and max in seconds (None when nothing was measured)."""
    if not values_ms:
        return {**{f"p{p}": None for p in PERCENTILES}, "max": None}
    array = np.asarray(values_ms, dtype=float) / 1000
    return {**{f"p{p}": round(float(np.percentile(array, p)), 3) for p in PERCENTILES},
            "max": round(float(array.max()), 3)}


@dataclass
class Level:
    priority: int
    classes: list[str] = field(default_factory=list)
    arrived: int = 0
    served: int = 0  # got a first token
    shed: int = 0
    expired: int = 0
    unfinished: int = 0
    give_ways: int = 0
    completion_tokens: int = 0
    ttft_ms: list[int] = field(default_factory=list)
    queue_ms: list[int] = field(default_factory=list)

    def summary(self, span_s: float) -> dict:
        return {"priority": self.priority, "classes": self.classes, "arrived": self.arrived,
                "served": self.served, "shed": self.shed, "expired": self.expired,
                "unfinished": self.unfinished, "give_ways": self.give_ways,
                "tokens_per_s": round(self.completion_tokens / span_s, 2) if span_s else None,
                "ttft_s": spread(self.ttft_ms), "queue_s": spread(self.queue_ms)}


def summarize(outcome: Outcome, cost: dict[str, float] | None = None) -> dict:
    """The JSON of one run: per priority (highest first) and totals."""
    levels: dict[int, Level] = {}

    def level(priority: int, name: str) -> Level:
        lv = levels.setdefault(priority, Level(priority))
        if name not in lv.classes:
            lv.classes.append(name)
        return lv

    by_id = {a.id: a for a in outcome.arrivals}
    for a in outcome.arrivals:
        level(a.priority, a.name).arrived += 1
    for a in outcome.shed:
        level(a.priority, a.name).shed += 1
    for a in outcome.unfinished:
        level(a.priority, a.name).unfinished += 1
    busy_ms = 0
    for rid, r in outcome.records.items():
        a = by_id[rid]
        lv = level(a.priority, a.name)
        lv.give_ways += int(r.get("yields", 0))
        if r["status"] == "expired":
            lv.expired += 1
        if "claimed_ms" in r:
            lv.queue_ms.append(int(r["claimed_ms"]) - a.at_ms)
            busy_ms += int(r["finished_ms"]) - int(r["claimed_ms"])
        if "first_token_ms" in r:
            lv.served += 1
            lv.ttft_ms.append(int(r["first_token_ms"]) - a.at_ms)
            lv.completion_tokens += int(r.get("completion_tokens", 0))
    start = min((a.at_ms for a in outcome.arrivals), default=0)
    span_s = max(0.0, (outcome.end_ms - start) / 1000)
    capacity_ms = outcome.workers * outcome.slots * (outcome.end_ms - start)
    tokens = sum(lv.completion_tokens for lv in levels.values())
    totals = {"requests": len(outcome.arrivals), "served": sum(lv.served for lv in levels.values()),
              "simulated_s": round(span_s, 3), "tokens_per_s": round(tokens / span_s, 2) if span_s else None,
              "requests_per_s": round(sum(lv.served for lv in levels.values()) / span_s, 3) if span_s else None,
              "slot_utilisation": round(busy_ms / capacity_ms, 4) if capacity_ms else None,
              "workers": outcome.workers, "slots_per_worker": outcome.slots, "steps": outcome.steps}
    if cost:
        totals.update({name: round(value, 2) for name, value in cost.items()})
        totals["speed_x"] = round(span_s / cost["wall_s"], 1) if cost["wall_s"] else None
    return {"priorities": [levels[p].summary(span_s) for p in sorted(levels, reverse=True)], "totals": totals}


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def table(name: str, summary: dict) -> Table:
    t = Table(title=f"strata simulate: {name}")
    for col in ("priority", "classes", "arrived", "served", "TTFT p50 s", "p90", "p99", "max", "queue p50 s",
                "p90", "p99", "max", "give-ways", "shed", "expired", "tok/s"):
        t.add_column(col, justify="left" if col == "classes" else "right")
    for lv in summary["priorities"]:
        ttft, queue = lv["ttft_s"], lv["queue_s"]
        t.add_row(str(lv["priority"]), ", ".join(lv["classes"]), str(lv["arrived"]), str(lv["served"]),
                  *(_s(ttft[k]) for k in ("p50", "p90", "p99", "max")),
                  *(_s(queue[k]) for k in ("p50", "p90", "p99", "max")),
                  str(lv["give_ways"]), str(lv["shed"]), str(lv["expired"]), _s(lv["tokens_per_s"]))
    t.caption = _caption(summary["totals"])
    return t


def _caption(totals: dict) -> str:
    text = (f"{totals['workers']} workers x {totals['slots_per_worker']} slots, {totals['simulated_s']:.0f} s "
            f"simulated: {_s(totals['tokens_per_s'])} tok/s, slot utilisation "
            f"{100 * (totals['slot_utilisation'] or 0):.0f} %")
    if "wall_s" in totals:
        text += (f"; ran in {totals['wall_s']:.1f} s ({totals['speed_x']}x real time; CPU {totals['cpu_s']:.1f} s "
                 f"+ Redis {totals['redis_cpu_s']:.1f} s)")
    return text


def compare_table(names: tuple[str, str], summaries: tuple[dict, dict]) -> Table:
    """The same arrivals under two configurations: each cell reads `A | B`."""
    t = Table(title=f"strata simulate --compare: A = {names[0]}, B = {names[1]}")
    for col in ("priority", "TTFT p50 s", "TTFT p90", "TTFT p99", "queue p99 s", "give-ways", "shed", "expired",
                "tok/s"):
        t.add_column(col, justify="right")
    a_levels = {lv["priority"]: lv for lv in summaries[0]["priorities"]}
    b_levels = {lv["priority"]: lv for lv in summaries[1]["priorities"]}
    for p in sorted(set(a_levels) | set(b_levels), reverse=True):
        a, b = a_levels.get(p), b_levels.get(p)

        def pair(get) -> str:  # noqa: ANN001
            return f"{get(a) if a else '–'} | {get(b) if b else '–'}"

        t.add_row(str(p), pair(lambda lv: _s(lv["ttft_s"]["p50"])), pair(lambda lv: _s(lv["ttft_s"]["p90"])),
                  pair(lambda lv: _s(lv["ttft_s"]["p99"])), pair(lambda lv: _s(lv["queue_s"]["p99"])),
                  pair(lambda lv: lv["give_ways"]), pair(lambda lv: lv["shed"]), pair(lambda lv: lv["expired"]),
                  pair(lambda lv: _s(lv["tokens_per_s"])))
    t.caption = f"A: {_caption(summaries[0]['totals'])}\nB: {_caption(summaries[1]['totals'])}"
    return t
