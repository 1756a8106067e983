"""API keys: 401 without a right one, the key's default and maximum priority (and the header that
says so), the key's models, an open server without a keys file, and no secret in Redis."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest

from api.api_keys import KeysFileError, load_keys
from queues.keys import Keys
from queues.membership import Membership
from queues.worker_state import WorkerState
from tests.helpers.workers import MODEL

K = Keys(MODEL)
ALERTS = "sk-alerts-3f9a7c1e5b"
BATTERY = "sk-battery-8d2e4a6c0f"
OPS = "sk-ops-hashed-71b5c9e3"

KEYS_YAML = f"""
keys:
  - name: alerts
    key: "{ALERTS}"
    default_priority: 3
    max_priority: 5
  - name: battery
    key: "{BATTERY}"
    default_priority: -5
    models: [some-other-model]
  - name: ops
    key_sha256: "{hashlib.sha256(OPS.encode()).hexdigest()}"
"""


@pytest.fixture
def keyed(start_api, tmp_path) -> httpx.Client:
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS_YAML)
    return start_api(keys_file=str(path))


def ask(http: httpx.Client, key: str | None, **body) -> httpx.Response:
    """A streamed completion: the headers come back at once (no worker needed); leaving cancels it."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True, **body},
                     headers=headers) as response:
        response.read() if response.status_code != 200 else None
        return response


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


def test_priority_is_lowered_to_the_keys_maximum_and_says_so(keyed):
    response = ask(keyed, ALERTS, priority=9)
    assert response.status_code == 200
    assert response.headers["x-strata-priority"] == "5"
    assert response.headers["x-strata-priority-lowered"] == "9->5"
    within = ask(keyed, ALERTS, priority=4)
    assert within.headers["x-strata-priority"] == "4" and "x-strata-priority-lowered" not in within.headers
    assert ask(keyed, ALERTS, priority=-20).headers["x-strata-priority"] == "-20"


def test_a_request_without_priority_takes_the_keys_default(keyed, redis_client):
    response = ask(keyed, ALERTS)
    assert response.headers["x-strata-priority"] == "3"
    assert "x-strata-priority-lowered" not in response.headers
    assert ask(keyed, ALERTS, priority="high").headers["x-strata-priority"] == "3"  # not an integer
    record = redis_client.hgetall(K.req(response.headers["x-request-id"]))
    assert record["priority"] == "3" and record["key_name"] == "alerts"
    assert ask(keyed, OPS).headers["x-strata-priority"] == "0"  # ops: default 0, no maximum
    assert ask(keyed, OPS, priority=100).headers["x-strata-priority"] == "100"


def test_missing_or_wrong_key_is_401(keyed):
    for key in (None, "sk-wrong-000000000", ALERTS + "x", hashlib.sha256(OPS.encode()).hexdigest()):
        response = ask(keyed, key)
        assert response.status_code == 401, key
        assert error_code(response) == "invalid_api_key"
        assert response.json()["error"]["type"] == "invalid_request_error"
    bad_scheme = keyed.get("/v1/models", headers={"Authorization": f"Basic {ALERTS}"})
    assert bad_scheme.status_code == 401
    assert keyed.get("/v1/models").status_code == 401
    assert keyed.get("/health").status_code == 200 and keyed.get("/metrics").status_code == 200


def test_a_key_sees_and_uses_only_its_models(keyed, redis_client):
    Membership(redis_client, MODEL, "w1").heartbeat(WorkerState(), now_ms=int(time.time() * 1000), ttl_s=10)  # a live worker
    response = ask(keyed, BATTERY)
    assert response.status_code == 404 and error_code(response) == "model_not_found"
    battery = {"Authorization": f"Bearer {BATTERY}"}
    assert keyed.get("/v1/models", headers=battery).json()["data"] == []
    assert keyed.get(f"/v1/models/{MODEL}", headers=battery).status_code == 404
    alerts = {"Authorization": f"Bearer {ALERTS}"}
    assert [m["id"] for m in keyed.get("/v1/models", headers=alerts).json()["data"]] == [MODEL]


def test_without_a_keys_file_the_server_is_open(start_api):
    http = start_api()
    response = ask(http, None, priority=7)
    assert response.status_code == 200 and response.headers["x-strata-priority"] == "7"
    assert ask(http, "anything-at-all").status_code == 200


def test_no_secret_reaches_redis(keyed, redis_client):
    for key, priority in [(ALERTS, 9), (ALERTS, None), (OPS, 1), (BATTERY, 0), ("sk-wrong-000000000", 0)]:
        ask(keyed, key, **({} if priority is None else {"priority": priority}))
    keyed.get("/metrics")
    secrets = [ALERTS, BATTERY, OPS, "sk-wrong-000000000"]
    secrets += [hashlib.sha256(s.encode()).hexdigest() for s in secrets]
    seen = []
    for name in redis_client.scan_iter("*"):
        seen.append(name)
        kind = redis_client.type(name)
        if kind == "string":
            values = [redis_client.get(name)]
        elif kind == "hash":
            values = [x for pair in redis_client.hgetall(name).items() for x in pair]
        elif kind == "list":
            values = redis_client.lrange(name, 0, -1)
        elif kind == "set":
            values = list(redis_client.smembers(name))
        elif kind == "zset":
            values = redis_client.zrange(name, 0, -1)
        elif kind == "stream":
            values = [x for _id, fields in redis_client.xrange(name) for pair in fields.items() for x in pair]
        else:
            raise AssertionError(f"unexpected type {kind} of {name}")
        for text in [name, *values]:
            assert not any(s in text for s in secrets), (name, text)
    assert any(":req:" in n for n in seen)  # the requests were there to look at


def test_a_broken_keys_file_stops_startup_with_a_clear_error(tmp_path):
    cases = {
        "keys: [{name: a}]": "exactly one of 'key' and 'key_sha256'",
        "keys: [{name: a, key: sk-aaaaaaaa, default_priority: 9, max_priority: 5}]": "above max_priority",
        "keys: [{name: a, key: sk-aaaaaaaa}, {name: a, key: sk-bbbbbbbb}]": "unique",
        "nothing: here": "'keys' list",
    }
    for text, message in cases.items():
        path = tmp_path / "keys.yaml"
        path.write_text(text)
        with pytest.raises(KeysFileError, match=message) as raised:
            load_keys(path)
        assert "sk-" not in str(raised.value)
    toml = tmp_path / "keys.toml"
    toml.write_text('[[keys]]\nname = "t"\nkey = "sk-toml-12345"\nmax_priority = 2\nmodels = ["m"]\n')
    ring = load_keys(toml)
    found = ring.find("sk-toml-12345")
    assert found.name == "t" and found.max_priority == 2 and found.allows("m") and not found.allows("n")
    assert ring.find("sk-toml-1234") is None and "sk-" not in repr(found)
