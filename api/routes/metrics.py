"""GET /metrics: Prometheus text format, the same from every replica (api/prometheus.py)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from api import prometheus
from api.deps import ServicesDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def get_metrics(services: ServicesDep) -> Response:
    settings = services.settings
    labels = prometheus.PriorityLabels(settings.metrics_priorities)
    now = services.intake.clock()
    views = await prometheus.gather(services.redis, services.model_name, labels, now, int(settings.worker_live_s * 1000))
    return Response(prometheus.render(views, labels, now), media_type=CONTENT_TYPE_LATEST)
