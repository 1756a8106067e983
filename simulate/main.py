"""`strata simulate` and `strata calibrate`, end to end: read the workload and the profile, run
the fleet once (or twice on the same arrivals with --compare) on a scratch Redis, print the
table, write summary.json and the plots."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from engine.cost_profile import CostProfile
from queues.server import ScratchRedis
from simulate import fleet, plots, report, workload
from simulate.settings import CalibrateSettings, SimulateSettings


def simulate_once(settings: SimulateSettings, arrivals: list[workload.Arrival],
                  profile: CostProfile) -> tuple[fleet.Outcome, dict[str, float]]:
    """One run on a fresh scratch Redis; returns the outcome and what it cost: wall seconds, and
    CPU seconds of this process and of the Redis server (on a shared machine the wall time
    depends on the neighbours; the CPU time much less)."""
    with tempfile.TemporaryDirectory(prefix="strata-sim-") as folder:
        server = ScratchRedis(Path(folder)).start()
        client = server.client()
        try:
            started, cpu = time.perf_counter(), time.process_time()
            outcome = fleet.run(arrivals, client, settings, profile, workers=settings.workers,
                                max_waiting=settings.max_waiting, hard_limit=settings.queue_hard_limit,
                                ignore_priority=settings.ignore_priority, drain_s=settings.drain_s,
                                exact_reports=settings.exact_reports)
            redis_cpu = client.info("cpu")
            return outcome, {"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
                             "redis_cpu_s": float(redis_cpu["used_cpu_user"]) + float(redis_cpu["used_cpu_sys"])}
        finally:
            client.close()
            server.stop()


def describe(settings: SimulateSettings) -> str:
    parts = [f"{settings.workers} x {settings.parallel} slots", f"chunk {settings.prefill_chunk}"]
    if settings.reserve:
        parts.append("reserve " + ",".join(settings.reserve))
    if settings.aging_s:
        parts.append(f"aging {settings.aging_s:g} s")
    if not settings.prefill_preempt:
        parts.append("no give-way")
    if settings.ignore_priority:
        parts.append("priorities ignored")
    return ", ".join(parts)


def simulate(settings: SimulateSettings, console: Console | None = None) -> dict:
    """Run what the settings say; returns the JSON written as summary.json."""
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    traffic = workload.load(settings.workload)
    arrivals = workload.arrivals(traffic, settings.seed)
    profile_path = settings.profile_path()
    profile = CostProfile.load(profile_path)
    configs = [settings] + ([settings.variant()] if settings.compare else [])
    runs, summaries = [], []
    for config in configs:
        outcome, cost = simulate_once(config, arrivals, profile)
        runs.append((describe(config), outcome))
        summaries.append(report.summarize(outcome, cost))
    if len(runs) == 1:
        console.print(report.table(f"{settings.workload.name}, {runs[0][0]}", summaries[0]))
    else:
        for (name, _), summary in zip(runs, summaries):
            console.print(report.table(f"{settings.workload.name}, {name}", summary))
        console.print(report.compare_table((runs[0][0], runs[1][0]), (summaries[0], summaries[1])))
    result = {"workload": str(settings.workload), "profile": str(profile_path), "profile_machine": profile.machine,
              "seed": traffic.seed if settings.seed is None else settings.seed,
              "runs": [{"config": name, **summary} for (name, _), summary in zip(runs, summaries)]}
    if settings.out is not None:
        settings.out.mkdir(parents=True, exist_ok=True)
        (settings.out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
        plots.ttft_cdf(runs, settings.out / "ttft_cdf.png")
        plots.queue_length(runs, settings.out / "queue_length.png")
        console.print(f"wrote {settings.out}/summary.json, ttft_cdf.png, queue_length.png")
    return result


def calibrate(settings: CalibrateSettings, console: Console | None = None) -> CostProfile:
    from engine.files import resolve_model_path, served_model_name
    from simulate.calibrate import Plan, calibrate as measure, prompt_tokens
    from workers.main import build_engine

    console = console or Console()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = resolve_model_path(settings.model)
    # the engine a worker with these flags would run, its requests held to --ctx: the measurement
    # fills every slot at once, and a pool of --parallel x --ctx then gives each slot its own run
    # of blocks (engine/model.py allocate_cache) without the worker's pool handing them out
    engine = build_engine(settings.model_copy(update={"max_model_len": settings.max_model_len or settings.ctx}), path)
    plan = Plan.quick() if settings.quick else Plan()
    machine = {"model": settings.served_model_name or served_model_name(path), "device": settings.device,
               "dtype": str(getattr(engine, "dtype", settings.dtype)), "threads": str(settings.threads or "all"),
               "int4": str(settings.int4), "compile": str(settings.compile), "slots": str(settings.parallel),
               "ctx": str(settings.ctx), "plan": "quick" if settings.quick else "full"}
    profile = measure(engine, prompt_tokens(engine, settings.ctx), plan, machine)
    profile.save(settings.out)
    console.print(f"wrote {settings.out} (measured in {profile.machine['measured_s']} s)")
    return profile
