"""What `strata batch-worker` and the batch job can be told (STRATA_* variables or flags)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from queues.settings import REDIS_URL_ALIASES, redis_cluster_field, rq_redis_url_field


class BatchWorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STRATA_", extra="ignore")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=REDIS_URL_ALIASES,
        description="Redis holding the queues and the batches (and the RQ queue unless --rq-redis-url)",
    )
    redis_cluster: bool = redis_cluster_field()
    rq_redis_url: str | None = rq_redis_url_field()
    batch_inflight: int = Field(16, ge=1, description="most lines of one batch queued or running at once")
    batch_lease_ms: int = Field(
        30_000, ge=200, description="a batch whose job stopped renewing for this long is taken over by a new job"
    )
    batch_sweep_s: float = Field(5.0, gt=0, description="how often the worker looks for batches left without a job")
    batch_read_block_ms: int = Field(250, ge=10, description="longest block reading the lines' output streams")
    max_waiting: int = Field(1000, ge=0, description="as the API's: a line shed by the queue is retried later")
    queue_hard_limit: int = Field(10000, ge=0, description="as the API's")
    retention_s: int = Field(3600, ge=0, description="how long a cancelled line's request record stays")
