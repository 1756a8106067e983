"""`strata batch-worker`: an RQ worker on the batches' queue, plus a timer that gives every
unfinished batch without a live job a new one."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from batches.settings import BatchWorkerSettings
from batches.handoff import RQ_QUEUE, job_waiting, rq_url, submit_job
from queues.batches import BatchStatus, BatchStore
from queues.connect import connect

if TYPE_CHECKING:
    from rq import SimpleWorker

log = logging.getLogger("strata.batch")

# How long RQ's command listener waits for a message before looking whether it should stop: the
# batch worker's stop waits for it. RQ asks 60 s, and redis-py (8.x) joins that thread with no
# bound, so a SIGTERM landing just after the listener saw its unsubscribe kept the worker up to
# 60 s (`strata serve` killed it at 20).
LISTEN_WAIT_S = 0.5


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


def batch_rq_worker(client: redis.Redis) -> SimpleWorker:
    """RQ's in-process worker on the batches' queue, its command listener waking every
    `LISTEN_WAIT_S` so that a stop never waits on it."""
    from rq import Queue, SimpleWorker

    class Worker(SimpleWorker):
        def subscribe(self) -> None:  # RQ's own, but for the listener's wait
            self.pubsub = self.connection.pubsub()
            self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
            self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=LISTEN_WAIT_S, daemon=True,
                                                           exception_handler=self._pubsub_exception_handler)

    return Worker([Queue(RQ_QUEUE, connection=client)], connection=client)


def run_batch_worker(settings: BatchWorkerSettings) -> None:
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
    batch_rq_worker(client).work(logging_level="INFO")
