"""GET /v1/models, GET /v1/models/{model_id}"""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import ServicesDep
from api.errors import ApiError
from api.schemas import ModelCard, ModelList

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def list_models(services: ServicesDep) -> ModelList:
    return ModelList(data=[ModelCard(id=services.model_name, created=services.started_s)])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, services: ServicesDep) -> ModelCard:
    if model_id != services.model_name:
        raise ApiError(404, f"The model '{model_id}' does not exist.", code="model_not_found", param="model")
    return ModelCard(id=services.model_name, created=services.started_s)
