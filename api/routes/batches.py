"""/v1/batches: create a batch from an uploaded file, read it, list them, cancel one (what each
does: api/batches.py)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter

from api import batches
from api.batch_deps import BatchServicesDep
from api.deps import KeyDep, ServicesDep
from shapes.batches import Batch, BatchCreate, BatchList

router = APIRouter(tags=["batches"])


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, services: ServicesDep, batch: BatchServicesDep, key: KeyDep) -> Batch:
    return Batch.from_record(await batches.create(body, services, batch, key))


@router.get("/v1/batches")
async def list_batches(batch: BatchServicesDep, limit: int = 20, after: str | None = None) -> BatchList:
    found, more = await anyio.to_thread.run_sync(lambda: batch.batches.list(max(1, min(limit, 100)), after))
    data = [Batch.from_record(b) for b in found]
    return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=more)


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, batch: BatchServicesDep) -> Batch:
    found = await anyio.to_thread.run_sync(batch.batches.get, batch_id)
    if found is None:
        raise batches.not_found(batch_id)
    return Batch.from_record(found)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, batch: BatchServicesDep) -> Batch:
    return Batch.from_record(await batches.cancel(batch, batch_id))
