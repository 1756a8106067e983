"""What the /v1/files and /v1/batches routes need: the file and batch stores (sync Redis,
called in threads) and RQ's Redis for the batch jobs, built once by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import redis
from fastapi import Depends, Request

from api.settings import ApiSettings
from batches.handoff import rq_url
from queues.batches import BatchStore
from queues.connect import connect as connect_redis
from queues.files import FileStore


@dataclass(frozen=True)
class BatchServices:
    redis: redis.Redis  # sync, bytes: the queues' Redis (a cluster client on a cluster)
    rq: redis.Redis  # sync, bytes (RQ stores pickles): RQ's own plain Redis, often the same server
    files: FileStore
    batches: BatchStore

    @classmethod
    def connect(cls, settings: ApiSettings) -> "BatchServices":
        client = connect_redis(settings.redis_url, cluster=settings.redis_cluster, decode_responses=False)
        rq = connect_redis(rq_url(settings.redis_url, settings.redis_cluster, settings.rq_redis_url),
                           decode_responses=False)
        return cls(client, rq, FileStore(client), BatchStore(client))

    def close(self) -> None:
        self.redis.close()
        self.rq.close()


async def get_batch_services(request: Request) -> BatchServices:  # async: no thread hop (api/deps.py)
    return request.state.batch_services


BatchServicesDep = Annotated[BatchServices, Depends(get_batch_services)]
