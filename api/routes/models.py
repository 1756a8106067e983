"""GET /v1/models, GET /v1/models/{model_id}: the served model while a worker of it is live
(heartbeat within `worker_live_s`) and the caller's key may use it. Requests for the model are
accepted even when no worker is live (they wait for one); /health reports a stall."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import KeyDep, ServicesDep
from queues.membership import live_workers
from shapes.errors import ApiError
from shapes.responses import ModelCard, ModelList

router = APIRouter(tags=["models"])


async def _listed(services: ServicesDep, key: KeyDep) -> list[ModelCard]:
    if key is not None and not key.allows(services.model_name):
        return []
    live = await live_workers(services.redis, services.model_name, services.intake.clock(),
                              int(services.settings.worker_live_s * 1000))
    return [ModelCard(id=services.model_name, created=services.started_s)] if live else []


@router.get("/v1/models")
async def list_models(services: ServicesDep, key: KeyDep) -> ModelList:
    return ModelList(data=await _listed(services, key))


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, services: ServicesDep, key: KeyDep) -> ModelCard:
    for card in await _listed(services, key):
        if card.id == model_id:
            return card
    raise ApiError(404, f"The model '{model_id}' does not exist or has no live worker.",
                   code="model_not_found", param="model")
