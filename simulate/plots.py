"""The pictures of a simulation (matplotlib, PNG): time to first token as a CDF per priority,
and the queue's length over time by priority. With --compare, A solid and B dashed, one colour
per priority."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from simulate.fleet import Outcome  # noqa: E402

STYLES = ("-", "--")


def _colours(priorities: Sequence[int]) -> dict[int, str]:
    cmap = plt.get_cmap("viridis")
    ordered = sorted(set(priorities), reverse=True)
    return {p: cmap(i / max(1, len(ordered) - 1) * 0.85) for i, p in enumerate(ordered)}


def _ttfts(outcome: Outcome) -> dict[int, np.ndarray]:
    by_id = {a.id: a for a in outcome.arrivals}
    found: dict[int, list[float]] = {}
    for rid, record in outcome.records.items():
        if "first_token_ms" in record:
            a = by_id[rid]
            found.setdefault(a.priority, []).append((int(record["first_token_ms"]) - a.at_ms) / 1000)
    return {p: np.sort(np.asarray(v)) for p, v in found.items()}


def ttft_cdf(runs: Sequence[tuple[str, Outcome]], path: Path, title: str = "Time to first token") -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    colours = _colours([a.priority for _, o in runs for a in o.arrivals])
    for style, (name, outcome) in zip(STYLES, runs):
        for p, values in sorted(_ttfts(outcome).items(), reverse=True):
            label = f"priority {p}" + (f" ({name})" if len(runs) > 1 else "")
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", linestyle=style,
                    color=colours[p], label=label)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def queue_series(outcome: Outcome) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per priority: times (s) and the number waiting for a slot from then on (a step function),
    from each request's arrival to its claim (or its expiry, or the end)."""
    shed = {a.id for a in outcome.shed}
    events: dict[int, list[tuple[int, int]]] = {}
    for a in outcome.arrivals:
        if a.id in shed:
            continue
        record = outcome.records.get(a.id, {})
        left = record.get("claimed_ms") or record.get("finished_ms") or outcome.end_ms
        events.setdefault(a.priority, []).extend([(a.at_ms, 1), (int(left), -1)])
    series = {}
    for p, changes in events.items():
        changes.sort(key=lambda change: (change[0], -change[1]))  # an arrival before a claim in the same ms
        times = np.asarray([t for t, _ in changes], dtype=float) / 1000
        series[p] = (times, np.cumsum([d for _, d in changes]))
    return series


def queue_length(runs: Sequence[tuple[str, Outcome]], path: Path, title: str = "Waiting for a slot") -> Path:
    fig, axes = plt.subplots(len(runs), 1, figsize=(6.4, 2.4 * len(runs) + 0.6), dpi=100, sharex=True, squeeze=False)
    colours = _colours([a.priority for _, o in runs for a in o.arrivals])
    for ax, (name, outcome) in zip(axes[:, 0], runs):
        for p, (times, counts) in sorted(queue_series(outcome).items(), reverse=True):
            ax.step(times, counts, where="post", color=colours[p], label=f"priority {p}")
        ax.set_ylabel("requests waiting")
        ax.grid(alpha=0.3)
        ax.set_title(name if len(runs) > 1 else title, fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    if len(runs) > 1:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
