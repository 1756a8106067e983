"""The access log is an option like any other: a flag of `strata serve` and `strata api`, a
STRATA_ variable, and what serve hands its API children reaches uvicorn."""

from __future__ import annotations

import socket

import pytest
import uvicorn
from pydantic_settings import CliApp

import api.app
from api.settings import ApiSettings
from strata.cli import ServeCommand, Strata
from strata.serve import child_env


@pytest.fixture(autouse=True)
def _no_settings_in_env(monkeypatch):
    for name in ("STRATA_ACCESS_LOG", "REDIS_URL", "STRATA_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)


def uvicorn_config(monkeypatch, settings: ApiSettings) -> uvicorn.Config:
    """The Config api.app.run gives uvicorn, which is stopped before it serves."""
    seen: list[uvicorn.Config] = []

    class Server:
        def __init__(self, config: uvicorn.Config) -> None:
            seen.append(config)

        def run(self, sockets: list[socket.socket]) -> None:
            pass

    monkeypatch.setattr(uvicorn, "Server", Server)
    with socket.socket() as listening:
        api.app.run(settings, listening)
    return seen[0]


def test_on_unless_turned_off():
    assert ApiSettings().access_log is True
    assert ServeCommand().access_log is True


def test_the_flag_and_the_variable_turn_it_off(monkeypatch):
    for command in ("serve", "api"):
        parsed = CliApp.run(Strata, cli_args=[command, "--no-access-log"], cli_cmd_method_name="model_dump")
        assert getattr(parsed, command).access_log is False
    monkeypatch.setenv("STRATA_ACCESS_LOG", "false")
    assert ApiSettings().access_log is False


@pytest.mark.parametrize("on", [True, False])
def test_serve_hands_it_to_the_api_and_the_api_to_uvicorn(monkeypatch, on):
    env = child_env(ServeCommand(access_log=on), "redis://127.0.0.1:1/0")
    monkeypatch.setenv("STRATA_ACCESS_LOG", env["STRATA_ACCESS_LOG"])
    settings = ApiSettings()
    assert settings.access_log is on
    assert uvicorn_config(monkeypatch, settings).access_log is on
