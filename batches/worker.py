"""`strata batch-worker`: an RQ worker on the batches' queue, plus a timer that gives every
unfinished batch without a live job a new one."""

from __future__ import annotations

import logging
import threading
import time

import redis

from batches.settings import BatchWorkerSettings
from batches.handoff import RQ_QUEUE, job_waiting, rq_url, submit_job
from queues.batches import BatchStatus, BatchStore
from queues.connect import connect

log = logging.getLogger("strata.batch")


def sweep(client: redis.Redis, rq: redis.Redis | None = None) -> list[str]:
    """Enqueue a job for every unfinished batch that nobody runs (no lease) and whose job is not
    waiting in the RQ queue: its worker died, the API stopped between storing it and queueing
    its job, or RQ's Redis lost it. Returns the batch ids taken up. `client`: the queues' Redis;
    `rq`: RQ's (None: the same)."""
    rq = client if rq is None else rq
    store = BatchStore(client)
    taken = []
    for batch_id in store.active():
        batch = store.get(batch_id)
        if batch is None or BatchStatus(batch["status"]).is_final:
            store.forget(batch_id)  # it ended (or expired away) after its last state change
            continue
        if store.is_leased(batch_id):
            continue
        if job_waiting(rq, batch.get("rq_job_id")):
            continue
        store.update(batch_id, {"rq_job_id": submit_job(rq, batch_id)})
        taken.append(batch_id)
    return taken


def run_batch_worker(settings: BatchWorkerSettings) -> None:
    from rq import Queue, SimpleWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        rq_redis = rq_url(settings.redis_url, settings.redis_cluster, settings.rq_redis_url)
    except ValueError as error:
        raise SystemExit(f"strata batch-worker: {error}") from None
    client = connect(rq_redis, decode_responses=False)  # RQ stores pickles

    def sweeping() -> None:
        sweeper = connect(settings.redis_url, cluster=settings.redis_cluster, decode_responses=False)
        rq = connect(rq_redis, decode_responses=False)
        while True:
            try:
                for batch_id in sweep(sweeper, rq):
                    log.info("batch %s had no live job: enqueued a new one", batch_id)
            except redis.exceptions.RedisError:
                log.warning("sweep failed", exc_info=True)
            time.sleep(settings.batch_sweep_s)

    threading.Thread(target=sweeping, name="batch-sweep", daemon=True).start()
    # The job runs in this process, not in a forked work horse: a fork copies only the forking
    # thread, so a lock the sweeper (or RQ's pubsub thread) held at that moment stays held forever
    # in the horse. The job needs no isolation: it holds a lease, and a worker that dies with it
    # only leaves the batch for the sweep to hand to another.
    worker = SimpleWorker([Queue(RQ_QUEUE, connection=client)], connection=client)
    worker.work(logging_level="INFO")
