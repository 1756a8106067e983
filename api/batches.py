"""What /v1/batches does: create a batch from an uploaded file, cancel one. Creating checks the
whole file at once (a 400 when it is not valid, see batches/lines.py), prepares every line with
the endpoint's own rules, stores the batch and hands it to RQ (batches/handoff.py); the RQ job
(batches/job.py) then feeds the lines into the model's queue at the batch's priority. The routes
are api/routes/batches.py."""

from __future__ import annotations

import json
import time
import uuid

import anyio

from api.api_keys import ApiKey
from api.batch_deps import BatchServices
from api.completions import check_key_may_use
from api.deps import Services
from api.priority import resolve_priority
from batches import lines
from batches.handoff import submit_job
from queues.batches import BatchNotFound, BatchStatus
from shapes.answers import ENDPOINTS
from shapes.batches import BatchCreate
from shapes.errors import ApiError

COMPLETION_WINDOWS = {"24h": 24 * 3600}


def not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", code="not_found", param="id")


async def create(body: BatchCreate, services: Services, batch: BatchServices, key: ApiKey | None) -> dict[str, str]:
    """The stored batch record of a new batch, its job handed to RQ."""
    settings = services.settings
    check_key_may_use(services, key)
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {list(ENDPOINTS)}.", code="invalid_value", param="endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise ApiError(400, f"completion_window must be one of {list(COMPLETION_WINDOWS)}.",
                       code="invalid_value", param="completion_window")
    stored = await anyio.to_thread.run_sync(batch.files.get, body.input_file_id)
    if stored is None:
        raise ApiError(404, f"No such File object: {body.input_file_id}", code="not_found", param="input_file_id")
    if stored.purpose != "batch":
        raise ApiError(400, "The input file's purpose must be 'batch'.", code="invalid_value", param="input_file_id")
    content = await anyio.to_thread.run_sync(batch.files.content, body.input_file_id) or b""
    raw = body.priority if body.priority is not None else settings.batch_priority
    # docs/design.md rule 1 with the caller's key: its maximum caps every line of the batch
    priority = resolve_priority(raw, settings.priority_min, settings.priority_max, key).value
    batch_id = f"batch_{uuid.uuid4().hex}"
    rules = await services.rules_now()

    def prepare() -> list[str]:
        parsed = lines.parse_file(content, body.endpoint, settings.batch_max_lines)
        return lines.prepare(parsed, body.endpoint, rules, batch_id)

    prepared = await anyio.to_thread.run_sync(prepare)
    now = int(time.time())
    record: dict[str, str | int] = {
        "id": batch_id, "endpoint": body.endpoint, "input_file_id": body.input_file_id,
        "completion_window": body.completion_window, "status": BatchStatus.VALIDATING, "created_at": now,
        "expires_at": now + COMPLETION_WINDOWS[body.completion_window], "total": len(prepared),
        "completed": 0, "failed": 0, "priority": priority, "model": services.model_name,
        "metadata": json.dumps(body.metadata) if body.metadata else "",
        "key_name": key.name if key is not None else "",
    }

    def store() -> dict[str, str] | None:
        batch.batches.create(record, prepared)
        batch.batches.update(batch_id, {"rq_job_id": submit_job(batch.rq, batch_id)})
        return batch.batches.get(batch_id)

    return await anyio.to_thread.run_sync(store)


async def cancel(batch: BatchServices, batch_id: str) -> dict[str, str]:
    """A validating or running batch becomes `cancelling`: its job stops feeding lines, cancels
    those in flight and ends in `cancelled`. Cancelling one already cancelling/cancelled is a
    no-op; a batch that ended otherwise answers 400."""

    def advance() -> dict[str, str]:
        status = batch.batches.advance(batch_id, (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
                                       BatchStatus.CANCELLING, "cancelling_at")
        if status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            raise ApiError(400, f"Cannot cancel a batch with status {str(status)!r}.", code="invalid_state", param="id")
        return batch.batches.get(batch_id) or {}

    try:
        return await anyio.to_thread.run_sync(advance)
    except BatchNotFound:
        raise not_found(batch_id) from None
