"""The options more than one process takes, each defined once. Every process's settings object
composes the bases it needs (api/settings.py, workers/settings.py, batches/settings.py,
simulate/settings.py; `strata serve` composes the API's and the worker's, which then share
these very fields): one option, one name, one default, one description, one flag and one
STRATA_ variable. The embedded Redis itself is queues/server.py."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# Every process reads its Redis from --redis-url, STRATA_REDIS_URL or the plain REDIS_URL.
REDIS_URL_ALIASES = AliasChoices("redis_url", "STRATA_REDIS_URL", "REDIS_URL")
CONFIG = SettingsConfigDict(env_prefix="STRATA_", populate_by_name=True, extra="ignore")


def environ_without_settings() -> dict[str, str]:
    """This process's environment minus every STRATA_ setting and REDIS_URL: a `strata` command
    started with it runs on its defaults and the flags it is given (tests, benches)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("STRATA_") and k != "REDIS_URL"}


def defined_by(cls: type, name: str) -> type:
    """The class whose own body defines the option `name` of settings class `cls`."""
    return next(c for c in cls.__mro__ if name in inspect.get_annotations(c))


def one_definition(*parts: type[BaseSettings]) -> None:
    """Settings classes a command composes (`strata serve`: the worker's and the API's) must not
    define one option twice: it would merge silently, the first part's default and bounds
    winning. A shared option belongs in a base here. Raises TypeError naming the options."""
    owners: dict[str, set[type]] = {}
    for part in parts:
        for name in part.model_fields:
            owners.setdefault(name, set()).add(defined_by(part, name))
    twice = {name: sorted(c.__qualname__ for c in found) for name, found in owners.items() if len(found) > 1}
    if twice:
        raise TypeError(f"options defined twice (move them to queues/settings.py): {twice}")


class RedisSettings(BaseSettings):
    """Every process that reaches the queues."""

    model_config = CONFIG

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", validation_alias=REDIS_URL_ALIASES,
        description="Redis (or Valkey) holding the queues; also read from plain REDIS_URL")
    redis_cluster: bool = Field(
        False, description="the Redis is a Redis Cluster (implied when the URL lists several nodes: "
                           "redis://host1:port1,host2:port2); see docs/operations.md")
    redis_connect_s: float = Field(30.0, ge=0, description="how long start-up keeps retrying to reach Redis")
    retention_s: int = Field(3600, ge=0, description="how long a finished request's hash and stream stay in Redis")


class QueueLimits(BaseSettings):
    """What an enqueue sheds by (the API, the batch job, the simulator)."""

    model_config = CONFIG

    max_waiting: int = Field(
        1000, ge=0, description="shed a request (429) when this many of its priority or higher already wait; "
                                "0 = never")
    queue_hard_limit: int = Field(10000, ge=0, description="shed every request when this many wait in all; 0 = no limit")


class RqSettings(BaseSettings):
    """The API (which hands a batch to RQ) and the batch worker (which runs it) must name the same."""

    model_config = CONFIG

    rq_redis_url: str | None = Field(
        None, description="a plain (non-cluster) Redis for RQ's batch job queue; unset: the queues' Redis, "
                          "which must then not be a cluster (RQ cannot run on one)")


class ModelSettings(BaseSettings):
    """What the API and the workers of one model agree on."""

    model_config = CONFIG

    model: str | None = Field(None, description="GGUF file or Hugging Face folder; default the bundled "
                                                "SmolLM2-135M-Instruct")
    served_model_name: str | None = Field(None, description="the name clients pass as `model`; default derived "
                                                            "from the file")
    data_dir: Path = Field(Path("data"), description="where the converted tokenizer and compiled code are cached "
                                                     "(`strata serve`: also the embedded Redis's files)")
    ctx: int = Field(2048, ge=16, description="tokens of KV pool per slot: --kv-tokens defaults to --parallel x --ctx "
                                              "(the memory a slot of its own took before the pool)")
    max_model_len: int | None = Field(None, ge=16, description="most tokens one request (prompt + answer) may hold; "
                                                               "default the model's own context (8192 for the "
                                                               "default SmolLM2)")
