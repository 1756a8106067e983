"""One option, one definition: the options several processes take are defined once
(queues/settings.py) and each process's settings compose them, so `strata serve`, which is the
API's and the worker's settings at once, hands both children the same value, and the two can
never disagree on a default or a bound."""

from __future__ import annotations

import pytest
from pydantic import Field

from api.settings import ApiSettings
from batches.settings import BatchWorkerSettings
from queues.settings import CONFIG, RedisSettings, defined_by, one_definition
from simulate.settings import CalibrateSettings, SimulateSettings
from strata.cli import ServeCommand
from strata.serve import child_env
from workers.settings import WorkerSettings

PROCESSES = (ApiSettings, WorkerSettings, BatchWorkerSettings, SimulateSettings, CalibrateSettings)
SHARED = ("redis_url", "redis_cluster", "redis_connect_s", "retention_s", "max_waiting", "queue_hard_limit",
          "rq_redis_url", "model", "served_model_name", "data_dir", "ctx")


@pytest.mark.parametrize("command", [WorkerSettings, SimulateSettings, CalibrateSettings])
def test_no_option_is_defined_in_two_process_settings(command):
    """What one deployment runs side by side (a simulated worker is a worker). Raises naming the
    options otherwise. (`out` of calibrate and simulate are two commands' own, never composed.)"""
    one_definition(command, ApiSettings, BatchWorkerSettings)


@pytest.mark.parametrize("name", SHARED)
def test_every_shared_option_is_defined_once_in_the_shared_bases(name):
    owners = {defined_by(cls, name) for cls in PROCESSES if name in cls.model_fields}
    assert len(owners) == 1 and next(iter(owners)).__module__ == "queues.settings"
    assert sum(name in cls.model_fields for cls in PROCESSES) >= 2


def test_two_definitions_of_one_option_are_refused():
    class Mine(RedisSettings):
        model_config = CONFIG
        retention_s: int = Field(60, ge=0, description="a second definition")

    with pytest.raises(TypeError, match="retention_s"):
        one_definition(Mine, WorkerSettings)


def test_serve_hands_both_children_the_one_value_it_was_given(monkeypatch):
    """Before, serve's redis_connect_s was the worker's 20 s default and the API's 30 s was lost."""
    for name in ("REDIS_URL", "STRATA_REDIS_URL", "STRATA_REDIS_CONNECT_S", "STRATA_CTX", "STRATA_RETENTION_S"):
        monkeypatch.delenv(name, raising=False)
    serve = ServeCommand(redis_connect_s=7, ctx=512, retention_s=60)
    env = child_env(serve, "redis://127.0.0.1:1/0")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for child in (ApiSettings(), WorkerSettings()):
        assert (child.redis_connect_s, child.ctx, child.retention_s) == (7, 512, 60)
        assert child.redis_url == "redis://127.0.0.1:1/0"
    assert ServeCommand().redis_connect_s == ApiSettings().redis_connect_s == WorkerSettings().redis_connect_s
