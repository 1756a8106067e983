"""Which package may import which: api → queues ← workers → engine; batches → queues; api and
batches share shapes (no FastAPI); simulate stands on workers, queues and engine; the `strata`
command and bench/ sit on top. A batch worker or a GPU worker loads neither FastAPI nor api/.
Every package of the repository is listed (a new one must say where it stands)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAY_IMPORT = {
    "queues": set(),
    "engine": set(),
    "workers": {"queues", "engine"},
    "shapes": {"queues"},
    "batches": {"queues", "shapes"},
    "api": {"queues", "shapes", "batches", "engine"},  # engine: the tokenizer and model files, loaded at startup
    "simulate": {"workers", "queues", "engine"},
    "strata": {"api", "batches", "engine", "queues", "simulate", "workers"},  # the command: every process
    "bench": {"api", "batches", "engine", "queues", "shapes", "simulate", "strata", "workers"},
}
OURS = set(MAY_IMPORT)


def test_every_package_of_the_repository_is_listed():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == OURS


def imported_packages(package: str) -> dict[str, set[str]]:
    """Our other packages each module of `package` imports (lazily or not): module path -> names."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = (names & OURS) - {package}
    return found


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_point_one_way(package):
    wrong = {module: names - MAY_IMPORT[package] for module, names in imported_packages(package).items()}
    assert {module: names for module, names in wrong.items() if names} == {}


def loaded_by(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


@pytest.mark.parametrize("module", ["workers.loop", "workers.main", "batches.job", "batches.worker"])
def test_workers_and_the_batch_job_load_neither_fastapi_nor_the_api(module):
    loaded = loaded_by(module)
    assert module in loaded
    assert {m for m in loaded if m.split(".")[0] in ("api", "fastapi", "starlette", "uvicorn")} == set()
