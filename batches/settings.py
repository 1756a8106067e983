"""What `strata batch-worker` and the batch job can be told (STRATA_* variables or flags)."""

from __future__ import annotations

from pydantic import Field

from queues.settings import CONFIG, QueueLimits, RedisSettings, RqSettings


class BatchWorkerSettings(RedisSettings, QueueLimits, RqSettings):
    """The shared options (queues/settings.py; a line shed by the queue is retried later), then
    the batch worker's own."""

    model_config = CONFIG

    batch_inflight: int = Field(16, ge=1, description="most lines of one batch queued or running at once")
    batch_lease_ms: int = Field(
        30_000, ge=200, description="a batch whose job stopped renewing for this long is taken over by a new job"
    )
    batch_sweep_s: float = Field(5.0, gt=0, description="how often the worker looks for batches left without a job")
    batch_read_block_ms: int = Field(250, ge=10, description="longest block reading the lines' output streams")
