"""API keys: loading the keys file and finding the key a request presents.

The file (YAML, or TOML when its name ends in .toml) lists keys:

    keys:
      - name: alerts               # shown to operators (request hash field key_name); unique
        key: "sk-alerts-..."       # the secret; or key_sha256: "<hex sha256 of the secret>"
        default_priority: 10       # a request that gives no (integer) priority gets this; default 0
        max_priority: 50           # a request asking more is lowered to it; default: no cap
        default_queue_timeout: 30  # seconds a request without queue_timeout may wait for a slot
        max_queue_timeout: 120     # a request asking longer is lowered to it; default: no cap
        models: [SmolLM2-135M-Instruct]   # optional: the models this key may use; absent = all

Only the SHA-256 digest of each secret is kept in memory after loading; a presented key is
hashed and compared with `hmac.compare_digest` against every digest. Secrets are never logged
and never written to Redis (only the key's name is)."""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes  # sha256 of the secret
    default_priority: int = 0
    max_priority: int | None = None  # None: no cap beyond the server's clamp range
    models: frozenset[str] | None = None  # None: every model
    default_queue_timeout: float | None = None  # seconds; None: requests wait as long as it takes
    max_queue_timeout: float | None = None  # seconds; None: no cap

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def __repr__(self) -> str:  # never print anything derived from the secret
        return f"ApiKey(name={self.name!r})"


class KeyRing:
    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    def find(self, presented: str) -> ApiKey | None:
        """The key whose secret is `presented`, or None. Every digest is compared (in constant
        time each), so the answer's timing does not depend on which key matched."""
        digest = _sha256(presented)
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def __len__(self) -> int:
        return len(self.keys)


class KeysFileError(ValueError):
    pass


def load_keys(path: str | Path) -> KeyRing:
    path = Path(path)
    raw = path.read_bytes()
    try:
        data = tomllib.loads(raw.decode()) if path.suffix == ".toml" else yaml.safe_load(raw)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as error:
        raise KeysFileError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {error}") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise KeysFileError(f"{path}: expected a top-level 'keys' list")
    keys = [_entry(path, i, entry) for i, entry in enumerate(entries)]
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise KeysFileError(f"{path}: key names must be unique")
    if len({k.digest for k in keys}) != len(keys):
        raise KeysFileError(f"{path}: two entries have the same secret")
    return KeyRing(keys)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _entry(path: Path, i: int, entry: object) -> ApiKey:
    where = f"{path}: keys[{i}]"
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: expected a mapping")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise KeysFileError(f"{where}: 'name' must be a non-empty string")
    where = f"{path}: key {name!r}"
    secret, hashed = entry.get("key"), entry.get("key_sha256")
    if (secret is None) == (hashed is None):
        raise KeysFileError(f"{where}: give exactly one of 'key' and 'key_sha256'")
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < 8:
            raise KeysFileError(f"{where}: 'key' must be a string of at least 8 characters")
        digest = _sha256(secret)
    else:
        try:
            digest = bytes.fromhex(str(hashed))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise KeysFileError(f"{where}: 'key_sha256' must be 64 hex digits")
    default = _int(entry.get("default_priority", 0), where, "default_priority")
    cap = entry.get("max_priority")
    cap = None if cap is None else _int(cap, where, "max_priority")
    if cap is not None and default > cap:
        raise KeysFileError(f"{where}: default_priority {default} is above max_priority {cap}")
    models = entry.get("models")
    if models is not None:
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise KeysFileError(f"{where}: 'models' must be a list of model names")
        models = frozenset(models)
    timeout = _seconds(entry.get("default_queue_timeout"), where, "default_queue_timeout")
    timeout_cap = _seconds(entry.get("max_queue_timeout"), where, "max_queue_timeout")
    if timeout is not None and timeout_cap is not None and timeout > timeout_cap:
        raise KeysFileError(f"{where}: default_queue_timeout {timeout:g} is above max_queue_timeout {timeout_cap:g}")
    return ApiKey(name, digest, default, cap, models, timeout, timeout_cap)


def _int(value: object, where: str, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise KeysFileError(f"{where}: '{field}' must be an integer")
    return value


def _seconds(value: object, where: str, field: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 7 * 24 * 3600:
        raise KeysFileError(f"{where}: '{field}' must be a number of seconds in (0, 604800]")
    return float(value)


def _sha256(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
