"""How close `strata simulate` comes to the real thing: the acceptance scenarios of
bench/priority_scenarios.py (alert during a battery, with and without priority; long read gives
way, with and without; the alert with a reserved slot) run on the real engine, each one's
requests recorded from their hashes (arrival time, priority, prompt and answer lengths) and
replayed through the simulator with a cost profile calibrated on the same engine just before.
Compares the time to first token of the request each scenario is about. On a shared machine the
engine's speed drifts between the calibration and the run, so the table also shows each run's
pace (real and simulated) and the replay with the profile scaled to the real run's own pace:
what is left then is the simulator's error, not the machine's.

    .venv/bin/python -m bench.sim_fidelity [--profile data/cost-profile.json] [--no-calibrate] [--scale 1.0]
        [--threads N] [--timeline]

`--timeline` prints, per scenario, each request's claim, first token and end (ms after the first
arrival) in the real run and in the replay at the real pace: where the two schedules part.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.priority_scenarios import Run, alert_during_battery, long_read_gives_way, reserved_slot
from engine import load_engine
from engine.cost_profile import CostGrid, CostProfile
from engine.files import resolve_model_path, served_model_name
from queues.keys import Member
from queues.server import EmbeddedRedis, ScratchRedis
from simulate import fleet
from simulate.calibrate import Plan, calibrate, prompt_tokens
from simulate.workload import Arrival
from workers.scheduler import Policy, Reserve
from workers.settings import WorkerSettings


def recorded(run: Run, rids: list[str]) -> list[Arrival]:
    """The scenario's requests as the simulator replays them: times relative to the first."""
    records = {rid: run.record(rid) for rid in rids}
    start = min(int(r["enqueued_ms"]) for r in records.values())
    arrivals = [Arrival(rid, int(r["enqueued_ms"]) - start, int(r["priority"]), int(r["prompt_tokens"]),
                        int(r["completion_tokens"]), None, rid.split("-")[0]) for rid, r in records.items()]
    return sorted(arrivals, key=lambda a: Member.parse(records[a.id]["member"]).seq)  # enqueue order


def ttft_ms(record: dict[str, str]) -> int:
    return int(record["first_token_ms"]) - int(record["enqueued_ms"])


def pace(records: list[dict[str, str]]) -> tuple[float | None, float | None]:
    """How fast the engine went: ms per decode step of the longest answers (first token to the
    end), and ms per prompt token of reads that ran alone (claim to first token)."""
    answers = [r for r in records if int(r["completion_tokens"]) > 20]
    decode = [(int(r["finished_ms"]) - int(r["first_token_ms"])) / (int(r["completion_tokens"]) - 1) for r in answers]
    reads = [(int(r["first_token_ms"]) - int(r["claimed_ms"])) / int(r["prompt_tokens"]) for r in records
             if int(r["prompt_tokens"]) > 500 and not r.get("yields")]
    return (sum(decode) / len(decode) if decode else None), (min(reads) if reads else None)


def said(speed: tuple[float | None, float | None]) -> str:
    decode, read = speed
    return ", ".join(([f"{decode:.0f} ms/step"] if decode else []) + ([f"{read:.1f} ms/prompt token"] if read else []))


def at_pace(profile: CostProfile, real: tuple[float | None, float | None],
            simulated: tuple[float | None, float | None]) -> CostProfile:
    """The profile scaled so that the simulation goes at the pace the real run went (one factor
    for decode steps, one for reads; the one measured stands in for the other). Not a
    prediction: it takes the engine's speed out of the comparison, leaving the schedule."""
    factors = [r / s if r and s else None for r, s in zip(real, simulated)]
    known = [f for f in factors if f]
    if not known:
        return profile
    decode, read = (f or known[0] for f in factors)
    scaled = lambda grid, k: CostGrid(grid.rows, grid.columns, [[v * k for v in row] for row in grid.ms])  # noqa: E731
    return CostProfile(scaled(profile.read, read), scaled(profile.decode, decode), profile.machine,
                       profile.step_overhead_ms)


def replay(arrivals: list[Arrival], settings: WorkerSettings, profile: CostProfile,
           focus: str) -> tuple[int, tuple[float | None, float | None], dict[str, dict[str, str]]]:
    with tempfile.TemporaryDirectory(prefix="strata-fidelity-") as folder:
        server = ScratchRedis(Path(folder)).start()
        client = server.client()
        try:
            outcome = fleet.run(arrivals, client, settings, profile)
        finally:
            client.close()
            server.stop()
    by_id = {a.id: a for a in arrivals}
    records = [{**r, "prompt_tokens": str(by_id[rid].prompt_tokens)} for rid, r in outcome.records.items()]
    return int(outcome.records[focus]["first_token_ms"]) - by_id[focus].at_ms, pace(records), outcome.records


def timeline(name: str, arrivals: list[Arrival], real: dict[str, dict[str, str]],
             simulated: dict[str, dict[str, str]]) -> Table:
    """Each request's claim, first token and end, ms after the first arrival: real / simulated."""
    start_ms = int(real[arrivals[0].id]["enqueued_ms"]) - arrivals[0].at_ms  # `recorded`'s first arrival
    table = Table(title=f"{name}: real / simulated at the real pace, ms after the first arrival")
    for col in ("request", "priority", "arrives", "claimed", "first token", "finished"):
        table.add_column(col, justify="left" if col == "request" else "right")
    for a in sorted(arrivals, key=lambda a: int(real[a.id]["claimed_ms"])):
        # the replay's clock starts at the first arrival
        cells = [f"{int(real[a.id][k]) - start_ms} / {simulated[a.id][k]}"
                 for k in ("claimed_ms", "first_token_ms", "finished_ms")]
        table.add_row(a.id, str(a.priority), str(a.at_ms), *cells)
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", type=Path, default=Path("data/cost-profile.json"))
    parser.add_argument("--no-calibrate", action="store_true", help="use --profile as it is")
    parser.add_argument("--quick", action="store_true", help="calibrate with the quick plan (a smoke run)")
    parser.add_argument("--recalibrate", action="store_true",
                        help="also calibrate again right before each scenario and replay it with that profile too: "
                             "on a machine whose load drifts, this separates the simulator's error from the drift")
    parser.add_argument("--scale", type=float, default=1.0, help="answer and prompt lengths")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--timeline", action="store_true", help="each scenario's requests, real against replayed")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores); on a "
                        "machine shared with other jobs, 1 keeps the engine's speed steadier between calibration "
                        "and the real runs")
    args = parser.parse_args()
    path = resolve_model_path(None)
    model = served_model_name(path)
    # one token a step, as the simulator prices steps (prompt lookup's two-token steps it does not model)
    engine = load_engine(path, num_slots=args.parallel, ctx=2048, threads=args.threads, prompt_lookup=False)
    machine = {"model": model, "device": "cpu", "dtype": str(engine.dtype), "slots": str(args.parallel),
               "threads": str(args.threads or "all"), "ctx": str(engine.ctx), "plan": "quick" if args.quick else "full"}

    def measured() -> CostProfile:
        return calibrate(engine, prompt_tokens(engine, engine.ctx), Plan.quick() if args.quick else Plan(), machine)

    if args.no_calibrate:
        profile = CostProfile.load(args.profile)
    else:
        profile = measured()
        profile.save(args.profile)
    tokens = engine.tokenizer.encode((Path(__file__).parent / "priority_scenarios.py").read_text() * 4)
    server = EmbeddedRedis(Path(tempfile.mkdtemp()), appendonly=False).start()
    plain = WorkerSettings(parallel=args.parallel, prefill_chunk=args.chunk)
    reserve = WorkerSettings(parallel=args.parallel, prefill_chunk=args.chunk, reserve=["1:10"])
    battery = [f"battery-{i}" for i in range(3 * args.parallel)]
    scenarios = [
        ("alert during a battery, with priority", Policy(), plain, "alert", battery,
         lambda run: alert_during_battery(run, tokens, True, args.scale)),
        ("alert during a battery, without", Policy(), plain, "alert", battery,
         lambda run: alert_during_battery(run, tokens, False, args.scale)),
        ("long read gives way, with priority", Policy(), plain, "second", ["first"],
         lambda run: long_read_gives_way(run, tokens, True, args.scale)),
        ("long read gives way, without", Policy(), plain, "second", ["first"],
         lambda run: long_read_gives_way(run, tokens, False, args.scale)),
        ("alert with --reserve 1:10", Policy(reserve=(Reserve(1, 10),)), reserve, "alert", battery,
         lambda run: reserved_slot(run, tokens, args.scale)),
    ]
    table = Table(title=f"simulated vs real time to first token (SmolLM2, {engine.dtype}, {args.parallel} slots, "
                        f"chunk {args.chunk})")
    columns = ["scenario", "request", "real", "simulated", "error", "engine pace: real", "simulated",
               "simulated at the real pace", "error"]
    if args.recalibrate:
        columns += ["simulated, profile just before", "error", "its pace"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("scenario", "request") or "pace:" in col else "right")
    timelines: list[Table] = []
    try:
        for name, policy, settings, focus, others, scenario in scenarios:
            fresh = measured() if args.recalibrate else None
            with Run(server.url, model, engine, args.chunk, policy) as run:
                scenario(run)
                arrivals = recorded(run, [focus, *others])
                real = ttft_ms(run.record(focus))
                real_records = {a.id: run.record(a.id) for a in arrivals}
                real_pace = pace(list(real_records.values()))

            def cells(simulated: int) -> list[str]:
                return [f"{simulated / 1000:.2f} s", f"{100 * (simulated - real) / real:+.1f} %"]  # noqa: B023

            simulated, simulated_pace, _ = replay(arrivals, settings, profile, focus)
            paced, _, paced_records = replay(arrivals, settings, at_pace(profile, real_pace, simulated_pace), focus)
            if args.timeline:
                timelines.append(timeline(name, arrivals, real_records, paced_records))
            row = [name, focus, f"{real / 1000:.2f} s", *cells(simulated), said(real_pace), said(simulated_pace),
                   *cells(paced)]
            if fresh:
                again, again_pace, _ = replay(arrivals, settings, fresh, focus)
                row += [*cells(again), said(again_pace)]
            table.add_row(*row)
        Console(width=180).print(table)
        for t in timelines:
            Console(width=180).print(t)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
