"""The hand-off of a batch to RQ: which Redis RQ uses, the job that runs a batch, and whether
that job still waits. Only the hand-off lives in RQ: the batch, its lines and results stay in
the queues' Redis (queues/batches.py)."""

from __future__ import annotations

import redis

from queues.connect import is_cluster

RQ_QUEUE = "strata-batches"  # the RQ queue `strata batch-worker` listens on
JOB_FUNCTION = "batches.job.run_batch"


def rq_url(redis_url: str, cluster: bool, rq_redis_url: str | None) -> str:
    """RQ's Redis: --rq-redis-url, else the queues' own. RQ cannot use a Redis Cluster: its
    worker wants a single server's connection pool, its keys (`rq:job:<id>`, `rq:queues`, ...)
    share no hash tag, and its MULTI/EXEC pipelines span them. Only job hand-off lives there:
    batches, lines and results stay in the queues' Redis, and a lost RQ job is re-queued by the
    batch worker's sweep, so RQ's Redis needs no persistence of its own."""
    if rq_redis_url:
        return rq_redis_url
    if is_cluster(redis_url, cluster):
        raise ValueError("the queues' Redis is a cluster, where RQ cannot run: give RQ a plain Redis with "
                         "--rq-redis-url (STRATA_RQ_REDIS_URL)")
    return redis_url


def submit_job(client: redis.Redis, batch_id: str, timeout_s: int = 26 * 3600) -> str:
    """Enqueue the RQ job that runs a batch; returns its RQ job id. `client` must not decode
    responses (RQ stores pickles)."""
    from rq import Queue

    job = Queue(RQ_QUEUE, connection=client).enqueue_call(
        JOB_FUNCTION, args=(batch_id,), timeout=timeout_s, result_ttl=24 * 3600, failure_ttl=7 * 24 * 3600,
        description=f"batch {batch_id}",
    )
    return job.id


def job_waiting(client: redis.Redis, job_id: str | None) -> bool:
    """The RQ job is queued (or scheduled/deferred) and has not started yet."""
    if not job_id:
        return False
    from rq.exceptions import NoSuchJobError
    from rq.job import Job, JobStatus

    try:
        status = Job.fetch(job_id, connection=client).get_status()
    except NoSuchJobError:
        return False
    return status in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED)
