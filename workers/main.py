"""`strata worker`: one process, one device, one engine, pulling from Redis."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
from pathlib import Path

from engine.protocol import Engine
from queues.claims import Claims
from queues.connect import connect
from workers.loop import Worker
from workers.settings import WorkerSettings

log = logging.getLogger("strata.worker")


def dead_on_this_host(worker_id: str) -> bool:
    """Worker ids are `<host>-<pid>-<device>` (unless set by hand): one of this host whose process
    is gone is dead for sure, so its claims need not wait for their leases. Any other id (another
    host, a live or reused pid, a hand-set id) is left to its lease."""
    host = f"{socket.gethostname()}-"
    if not worker_id.startswith(host):
        return False
    pid = worker_id[len(host):].split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, someone else's
    return False


def build_engine(settings: WorkerSettings, path: Path) -> Engine:
    """The real engine from the model's weights, or (--engine fake) the fake on the wall clock:
    then the file only names the model, and nothing of it is read."""
    if settings.engine == "fake":
        from engine.fake_live import live_fake_engine

        return live_fake_engine(settings.parallel, settings.max_model_len or settings.ctx, settings.fake_read_ms_per_token,
                                settings.fake_decode_ms_per_step)
    from engine import load_engine
    from engine.files import cache_folder

    return load_engine(path, num_slots=settings.parallel, ctx=settings.max_model_len, kv_tokens=settings.pool_tokens(),
                       kv_dtype=settings.kv_dtype,
                       device=settings.device,
                       dtype=settings.dtype, threads=settings.threads, int4=settings.int4,
                       prefill_bf16=settings.prefill_bf16, prompt_int8=settings.prompt_int8, repack=settings.repack,
                       cache_dir=cache_folder(settings.data_dir),
                       compile=settings.compile, compile_in_background=settings.compile_background,
                       prompt_lookup=settings.prompt_lookup)


def run_worker(settings: WorkerSettings) -> None:
    from engine.files import resolve_model_path, served_model_name

    # the pid names the process: serve's workers share one log, and worker ids carry it too
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    # A model that is not there, of an architecture the engine lacks, or whose KV cache cannot fit
    # raises ConfigError here: `strata worker` then says so in one line and exits with code 2,
    # which `strata serve` does not restart (strata/cli.py, strata/serve.py).
    path = resolve_model_path(settings.model)
    name = settings.served_model_name or served_model_name(path)
    log.info("loading %s from %s on %s: %d slots, a KV pool of %d tokens, requests up to %s tokens", name, path,
             settings.device, settings.parallel, settings.pool_tokens(), settings.max_model_len or "the model's")
    engine = build_engine(settings, path)
    worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{settings.device}"
    claims = Claims(connect(settings.redis_url, cluster=settings.redis_cluster, within_s=settings.redis_connect_s), name, worker_id,
                    lease_ms=settings.lease_ms, retention_s=settings.retention_s, max_attempts=settings.max_attempts)
    worker = Worker(engine, claims, engine.tokenizer, prefill_chunk=settings.prefill_chunk, policy=settings.policy(),
                    device=settings.device, heartbeat_ms=int(settings.heartbeat_s * 1000),
                    idle_wait_s=settings.idle_wait_s, is_dead=dead_on_this_host)

    def stop(_signum: int, _frame: object) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # What loading built lives as long as the process: out of the collector's reach for good. A
    # full collection over it (~220 000 objects with the default model) takes ~120 ms, every
    # stream's next token held up by ~10 decode steps' time when one comes; frozen, ~0 (bench-log,
    # Dec 7). Full collections are rare (when the objects kept grow by a quarter), not never.
    gc.collect()
    gc.freeze()
    log.info("model %s from %s on %s%s", name, path, settings.device,
             " (fake engine: no weights loaded)" if settings.engine == "fake" else "")
    try:
        worker.run()
    finally:
        stop_building = getattr(engine, "stop_building", None)  # the real engine's build in the background
        if stop_building is not None:
            stop_building()
