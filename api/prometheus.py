"""/metrics: the queue, the workers and the finished requests of every model on this Redis, in
the Prometheus text format (prometheus_client writes it).

Any API replica may be scraped and workers have no HTTP server, so nothing is kept in this
process: gauges are read live from the queue's own keys at scrape time, counters and histograms
from the per-model hash the workers accumulate (queues/metrics.py). Every replica answers the
same numbers. Priorities are folded into bounded labels (PriorityLabels) so that clients choosing
priorities cannot multiply the number of series."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator

from prometheus_client.core import (
    CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from queues import membership
from queues import metrics as recorded_metrics
from queues.metrics import BUCKETS_MS, Histogram, ModelView


class PriorityLabels:
    """The `priority` label. Each configured priority is its own label ("0", "-10"); between two
    consecutive configured values a and b the priorities a+1..b-1 share the label "a+1..b-1"
    (one value: just that value); below the lowest configured value c: "<c"; above the highest
    d: ">d". With [-10, 0, 5, 10]: "<-10", "-10", "-9..-1", "0", "1..4", "5", "6..9", "10",
    ">10" -- at most 2n+1 labels for n configured values, whatever clients send."""

    def __init__(self, configured: Iterable[int]) -> None:
        values = sorted(set(configured))
        self.ranges: list[tuple[str, float, float]] = []  # (label, lo, hi), inclusive, ascending
        if not values:
            self.ranges.append(("all", -math.inf, math.inf))
            return
        self.ranges.append((f"<{values[0]}", -math.inf, values[0] - 1))
        for a, b in zip(values, values[1:]):
            self.ranges.append((str(a), a, a))
            if b - a > 1:
                lo, hi = a + 1, b - 1
                self.ranges.append((str(lo) if lo == hi else f"{lo}..{hi}", lo, hi))
        self.ranges.append((str(values[-1]), values[-1], values[-1]))
        self.ranges.append((f">{values[-1]}", values[-1] + 1, math.inf))

    def label(self, priority: int) -> str:
        for label, lo, hi in self.ranges:
            if lo <= priority <= hi:
                return label
        raise AssertionError("the ranges cover every integer")

    def bounds(self) -> list[tuple[float, float]]:
        return [(lo, hi) for _label, lo, hi in self.ranges]

    @property
    def labels(self) -> list[str]:
        return [label for label, _lo, _hi in self.ranges]


class Snapshot:
    """A prometheus_client collector over views read just now (one per model); collect()
    only formats, so the scrape's Redis reads stay async in the route."""

    def __init__(self, views: list[ModelView], labels: PriorityLabels, now_ms: int) -> None:
        self.views = views
        self.labels = labels
        self.now_ms = now_ms

    def collect(self) -> Iterator[Metric]:
        yield from self._gauges()
        yield from self._counters()
        yield from self._histograms()

    def _gauges(self) -> Iterator[Metric]:
        label = self.labels.label
        waiting = GaugeMetricFamily("strata_requests_waiting", "Requests waiting for a slot.",
                                    labels=["model", "priority"])
        running = GaugeMetricFamily("strata_requests_running", "Requests claimed by a worker (reading or decoding).",
                                    labels=["model", "priority"])
        live = GaugeMetricFamily("strata_workers_live", "Workers with a recent heartbeat.", labels=["model"])
        progress = GaugeMetricFamily(
            "strata_worker_progress_age_seconds",
            "Seconds since the newest heartbeat of any worker of the model (/health's stall measure).",
            labels=["model"])
        per_worker = {
            name: GaugeMetricFamily(f"strata_worker_{name}", doc, labels=["model", "worker"])
            for name, doc in [
                ("slots_total", "Slots of the worker."),
                ("slots_busy", "Slots holding a request."),
                ("reserved_slots_total", "Slots kept for high priorities (--reserve)."),
                ("reserved_slots_busy", "Reserved slots holding a request."),
                ("reads_in_progress", "1 while the worker's lines read a prompt, else 0."),
                ("reads_parked", "Reads that gave way and wait, parked in their slots."),
                ("heartbeat_age_seconds", "Seconds since the worker's last heartbeat."),
                ("kv_blocks_total", "Blocks of the worker's KV pool."),
                ("kv_blocks_free", "KV pool blocks admission may still promise."),
                ("kv_blocks_cached", "KV pool blocks holding a prefix a new prompt may reuse."),
                ("kv_blocks_shared", "KV pool blocks held by two slots or more."),
                ("kv_blocks_short", "Free KV blocks the head waiting for memory still needs (0: none waits)."),
            ]
        }
        for view in self.views:
            m = view.model
            for (name, _lo, _hi), count in zip(self.labels.ranges, view.waiting):
                waiting.add_metric([m, name], count)
            by_label = _count(label(p) for p in view.running)
            for name in self.labels.labels:
                running.add_metric([m, name], by_label.get(name, 0))
            live.add_metric([m], len(view.workers))
            if view.last_heartbeat_ms is not None:
                progress.add_metric([m], max(0, self.now_ms - view.last_heartbeat_ms) / 1000)
            for wid, w in view.workers:
                per_worker["slots_total"].add_metric([m, wid], w.slots_total)
                per_worker["slots_busy"].add_metric([m, wid], w.slots_busy)
                per_worker["reserved_slots_total"].add_metric([m, wid], len(w.reserved))
                per_worker["reserved_slots_busy"].add_metric([m, wid], w.reserved_busy)
                per_worker["reads_in_progress"].add_metric([m, wid], int(bool(w.reading)))
                per_worker["reads_parked"].add_metric([m, wid], len(w.parked))
                per_worker["heartbeat_age_seconds"].add_metric([m, wid], max(0, self.now_ms - w.heartbeat_ms) / 1000)
                for name in ("total", "free", "cached", "shared", "short"):
                    per_worker[f"kv_blocks_{name}"].add_metric([m, wid], getattr(w, f"blocks_{name}"))
        yield from (waiting, running, live, progress, *per_worker.values())

    def _counters(self) -> Iterator[Metric]:
        label = self.labels.label
        ended = CounterMetricFamily(
            "strata_requests_ended", "Requests that ended, by final status (finished, failed, cancelled on a worker; expired: no slot within queue_timeout).",
            labels=["model", "priority", "status"])
        specs = [
            ("strata_prompt_tokens", "Prompt tokens of finished requests (tokens in).", "prompt_tokens"),
            ("strata_completion_tokens", "Completion tokens of finished requests (tokens out).", "completion_tokens"),
            ("strata_give_ways", "Times a read gave way at a chunk boundary, by the priority of the read.", "give_ways"),
        ]
        simple = [(CounterMetricFamily(name, doc, labels=["model", "priority"]), attr) for name, doc, attr in specs]
        for view in self.views:
            m, rec = view.model, view.recorded
            totals: dict[tuple[str, str], int] = defaultdict(int)
            for (p, status), n in rec.requests.items():
                totals[(label(p), status)] += n
            for (name, status), n in sorted(totals.items()):
                ended.add_metric([m, name, status], n)
            for family, attr in simple:
                # every priority label from the start, at 0: a series born at its first event would
                # hide that event from rate() (Prometheus sees no step from "absent" to 1)
                folded = _fold(getattr(rec, attr), label)
                for name in self.labels.labels:
                    family.add_metric([m, name], folded.get(name, 0))
        yield ended
        yield from (family for family, _attr in simple)

    def _histograms(self) -> Iterator[Metric]:
        specs = [
            ("strata_queue_time_seconds", "From enqueue to the claim that served it, finished requests.", "queue_ms"),
            ("strata_time_to_first_token_seconds", "From enqueue to the first token, finished requests.",
             "first_token_ms"),
            ("strata_request_latency_seconds", "From enqueue to the end, finished requests.", "latency_ms"),
        ]
        for name, doc, field in specs:
            family = HistogramMetricFamily(name, doc, labels=["model", "priority"])
            for view in self.views:
                merged: dict[str, Histogram] = {}
                for p, hist in view.recorded.histograms[field].items():
                    into = merged.setdefault(self.labels.label(p), Histogram())
                    into.sum_ms += hist.sum_ms
                    for bound, n in hist.buckets.items():
                        into.buckets[bound] = into.buckets.get(bound, 0) + n
                for label, hist in sorted(merged.items()):
                    family.add_metric([view.model, label], _cumulative(hist), hist.sum_ms / 1000)
            yield family


def render(views: list[ModelView], labels: PriorityLabels, now_ms: int) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot(views, labels, now_ms))
    return generate_latest(registry)


async def gather(client, own_model: str, labels: PriorityLabels, now_ms: int, live_within_ms: int) -> list[ModelView]:  # noqa: ANN001
    """One view per model: this replica's model and every model a worker ever served here."""
    models = [own_model] + [m for m in await membership.known_models(client) if m != own_model]
    return [await recorded_metrics.view(client, m, labels.bounds(), now_ms, live_within_ms) for m in models]


def _cumulative(hist: Histogram) -> list[tuple[str, float]]:
    """Prometheus buckets (cumulative, seconds). A stored bound that is not one of BUCKETS_MS
    (written before they changed) counts in the next bound above it, so nothing is lost."""
    bounds = [*map(float, BUCKETS_MS), math.inf]
    counts = dict.fromkeys(bounds, 0)
    for bound, n in hist.buckets.items():
        counts[next(b for b in bounds if b >= bound)] += n
    buckets, running = [], 0
    for bound in bounds:
        running += counts[bound]
        buckets.append((floatToGoString(bound / 1000), running))
    return buckets


def _count(labels: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for name in labels:
        counts[name] += 1
    return counts


def _fold(by_priority: dict[int, int], label) -> dict[str, int]:  # noqa: ANN001
    folded: dict[str, int] = defaultdict(int)
    for p, n in by_priority.items():
        folded[label(p)] += n
    return folded
