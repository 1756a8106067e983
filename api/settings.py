"""Everything the API process can be told, from STRATA_* environment variables (or the CLI)."""

from __future__ import annotations

from pydantic import Field

from queues.settings import CONFIG, ModelSettings, QueueLimits, RedisSettings, RqSettings


class ApiSettings(RedisSettings, QueueLimits, RqSettings, ModelSettings):
    """The shared options (queues/settings.py), then the API's own."""

    model_config = CONFIG

    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port the HTTP server binds.")
    fd: int | None = Field(
        None, ge=0,
        description="Accept on this listening socket, inherited from a supervisor (`strata serve --api-workers N` "
        "hands one to each replica), instead of binding host:port.",
    )
    access_log: bool = Field(
        True,
        description="One line per HTTP request (uvicorn's access log: client, method, path, status). Off saves "
        "the line's CPU where many short requests come (docs/operations.md); errors are logged either way.",
    )
    priority_min: int = Field(-100, description="Lowest priority; lower values are raised to it.")
    priority_max: int = Field(100, description="Highest priority; higher values are lowered to it.")
    default_max_tokens: int = Field(
        256, ge=1, description="Answer length when a request gives no max_tokens."
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1, description="Largest request body (413 above).")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with a 429.")
    read_block_ms: int = Field(
        250, ge=10, le=5000,
        description="How long one read of the output stream blocks; also how often a gone client is noticed.",
    )
    redis_wait_s: float = Field(
        30.0, ge=0,
        description="An answer in progress waits this long for Redis to come back, then ends with an "
        "`unavailable` error event.",
    )
    keys_file: str | None = Field(
        None,
        description="API keys (YAML or .toml): name, key or key_sha256, default/max priority, models. "
        "Unset: the server is open.",
    )
    metrics_priorities: list[int] = Field(
        [-10, 0, 5, 10],
        description="Priorities /metrics labels exactly; others fall in the ranges between them "
        "('1..4'), below ('<-10') or above ('>10').",
    )
    health_stall_s: float = Field(
        60.0, gt=0,
        description="/health fails when requests wait and no worker of the model has made progress this long.",
    )
    worker_live_s: float = Field(
        10.0, gt=0, description="A worker with a heartbeat this recent is live: its model is listed in /v1/models."
    )
    batch_priority: int = Field(
        -10, description="Priority of a batch's lines when POST /v1/batches gives none (low: interactive goes first)."
    )
    batch_max_file_bytes: int = Field(
        64 * 1024 * 1024, ge=1, description="Largest file POST /v1/files accepts (413 above); files live in Redis."
    )
    batch_max_lines: int = Field(50_000, ge=1, description="Most requests in one batch input file (400 above).")
