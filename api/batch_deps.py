"""What the /v1/files and /v1/batches routes need: the file and batch stores (sync Redis,
called in threads) built once by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import redis
from fastapi import Depends, Request

from queues.batches import BatchStore
from queues.connect import connect as connect_redis
from queues.files import FileStore


@dataclass(frozen=True)
class BatchServices:
    redis: redis.Redis  # sync, bytes (RQ needs that too)
    files: FileStore
    batches: BatchStore

    @classmethod
    def connect(cls, url: str) -> "BatchServices":
        client = connect_redis(url, decode_responses=False)
        return cls(client, FileStore(client), BatchStore(client))


def get_batch_services(request: Request) -> BatchServices:
    return request.state.batch_services


BatchServicesDep = Annotated[BatchServices, Depends(get_batch_services)]
