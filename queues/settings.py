"""What every process that reaches the queues is configured with: where its Redis is, and how
the environment names it. Each process's settings object (api/, workers/, batches/) builds on
these; the embedded Redis itself is queues/server.py."""

from __future__ import annotations

import os
from typing import Any

from pydantic import AliasChoices, Field

# Every process reads its Redis from --redis-url, STRATA_REDIS_URL or the plain REDIS_URL.
REDIS_URL_ALIASES = AliasChoices("redis_url", "STRATA_REDIS_URL", "REDIS_URL")


def environ_without_settings() -> dict[str, str]:
    """This process's environment minus every STRATA_ setting and REDIS_URL: a `strata` command
    started with it runs on its defaults and the flags it is given (tests, benches)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("STRATA_") and k != "REDIS_URL"}


def redis_cluster_field() -> Any:  # noqa: ANN401 - a pydantic FieldInfo standing for a bool default
    """`--redis-cluster`, worded once for every process that connects."""
    return Field(False, description="the Redis is a Redis Cluster (implied when the URL lists several nodes: "
                                    "redis://host1:port1,host2:port2); see docs/operations.md")


def rq_redis_url_field() -> Any:  # noqa: ANN401 - a pydantic FieldInfo standing for a str | None default
    """`--rq-redis-url`, worded once for the API and the batch worker (both must name the same one)."""
    return Field(None, description="a plain (non-cluster) Redis for RQ's batch job queue; unset: the queues' Redis, "
                                   "which must then not be a cluster (RQ cannot run on one)")
