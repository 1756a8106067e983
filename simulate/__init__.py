"""Capacity planning: `strata calibrate` and `strata simulate`.

Its own folder because it is a product of its own that sits above the others: it drives the
real worker loop (workers/), the real Lua scripts in a real Redis (queues/) and the fake engine
(engine/fake.py) priced by a measured cost profile (engine/cost_profile.py), and nothing below
imports it. It knows no Redis key and no Lua (queues/replay.py and queues/claims.py do that)
and imports no torch (calibrate times the engine through engine.load_engine's public
interface).

- calibrate.py — time the real engine; write a cost profile.
- workload.py — the traffic file: classes, arrival processes, length distributions, traces.
- fleet.py — N workers on one virtual clock over a scratch Redis: the discrete event loop.
- report.py, plots.py — per-priority percentiles, table, JSON; the PNGs.
- main.py, settings.py — the two commands (flags in strata/cli.py's style).
"""
