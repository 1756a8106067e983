"""`strata batch-worker`: an RQ worker on the batches' queue, plus a timer that gives every
unfinished batch without a live job a new one."""

from __future__ import annotations

import logging
import threading
import time

import redis

from batches.settings import BatchWorkerSettings
from queues.batches import RQ_QUEUE, BatchStatus, BatchStore, job_waiting, submit_job
from queues.connect import connect

log = logging.getLogger("strata.batch")


def sweep(client: redis.Redis) -> list[str]:
    """Enqueue a job for every unfinished batch that nobody runs (no lease) and whose job is not
    waiting in the RQ queue: its worker died, or the API stopped between storing it and queueing
    its job. Returns the batch ids taken up."""
    store = BatchStore(client)
    taken = []
    for batch_id in store.active():
        batch = store.get(batch_id)
        if batch is None or BatchStatus(batch["status"]).is_final or store.is_leased(batch_id):
            continue
        if job_waiting(client, batch.get("rq_job_id")):
            continue
        store.update(batch_id, {"rq_job_id": submit_job(client, batch_id)})
        taken.append(batch_id)
    return taken


def run_batch_worker(settings: BatchWorkerSettings) -> None:
    from rq import Queue, Worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    client = connect(settings.redis_url, decode_responses=False)  # RQ stores pickles

    def sweeping() -> None:
        sweeper = connect(settings.redis_url, decode_responses=False)
        while True:
            try:
                for batch_id in sweep(sweeper):
                    log.info("batch %s had no live job: enqueued a new one", batch_id)
            except redis.exceptions.RedisError:
                log.warning("sweep failed", exc_info=True)
            time.sleep(settings.batch_sweep_s)

    threading.Thread(target=sweeping, name="batch-sweep", daemon=True).start()
    worker = Worker([Queue(RQ_QUEUE, connection=client)], connection=client)
    worker.work(logging_level="INFO")
