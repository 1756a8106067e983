"""`strata worker`: one process, one device, one engine, pulling from Redis."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

import redis

from queues.claims import Claims
from workers.loop import Worker
from workers.scheduler import Policy
from workers.settings import WorkerSettings

log = logging.getLogger("strata.worker")


def connect(url: str, attempts: int = 50) -> redis.Redis:
    """Redis may still be starting (or restarting): keep trying for a while."""
    client = redis.Redis.from_url(url, decode_responses=True, health_check_interval=30,
                                  retry_on_timeout=True)
    for attempt in range(attempts):
        try:
            client.ping()
            return client
        except redis.exceptions.ConnectionError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2)
    return client


def run_worker(settings: WorkerSettings) -> None:
    from engine import load_engine
    from engine.files import resolve_model_path, served_model_name

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = resolve_model_path(settings.model)
    name = settings.served_model_name or served_model_name(path)
    engine = load_engine(path, num_slots=settings.parallel, ctx=settings.ctx, device=settings.device,
                         dtype=settings.dtype, threads=settings.threads, int4_decode=settings.int4_decode)
    worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{settings.device}"
    claims = Claims(connect(settings.redis_url), name, worker_id,
                    lease_ms=settings.lease_ms, retention_s=settings.retention_s)
    policy = Policy(prefill_preempt=settings.prefill_preempt, yields_max=settings.yields_max,
                    batch_groups=settings.batch_groups, slot_low_first=settings.slot_low_first)
    worker = Worker(engine, claims, engine.tokenizer, prefill_chunk=settings.prefill_chunk, policy=policy,
                    device=settings.device, heartbeat_ms=int(settings.heartbeat_s * 1000),
                    idle_wait_s=settings.idle_wait_s)

    def stop(_signum: int, _frame: object) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("model %s from %s on %s", name, path, settings.device)
    worker.run()
