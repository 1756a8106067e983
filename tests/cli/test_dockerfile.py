"""The image holds what pyproject.toml says the project is. No Docker engine here, so the build
is checked without one: the files the Dockerfile COPYs (read from its COPY lines) are copied to
an empty folder, a wheel is built from that folder alone (`pip wheel --no-deps`, what the
image's `pip install .` does first), and the installed wheel runs the `strata` entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def listed_packages() -> set[str]:
    """The top-level packages pyproject.toml ships."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return {p.split(".")[0] for p in packages}


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY line, in order."""
    found = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            *sources, dest = line.split()[1:]
            found.append((sources, dest))
    return found


def test_the_dockerfile_copies_every_package_pyproject_lists_and_nothing_else():
    copied = {sources[0] for sources, dest in copies() if len(sources) == 1 and dest == f"./{sources[0]}"}
    assert copied == listed_packages()
    assert ["pyproject.toml", "README.md"] in [sources for sources, _ in copies()]


def test_what_the_dockerfile_copies_builds_and_runs(tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    for sources, dest in copies():
        for source in sources:
            path = ROOT / source
            target = context / dest / path.name if dest.endswith("/") else context / dest
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(context)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("strata-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n.split("/")[0] for n in names if n.endswith(".py")} == listed_packages()
    assert {"queues/lua/claim.lua", "queues/lua/_lib.lua", "simulate/profiles/cpu-smollm2.json"} <= names

    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    # run from the installed copy, not this checkout: strata --help imports every command (simulate too)
    code = ("import sys; sys.argv = ['strata', '--help']; import strata.cli, simulate.settings; "
            f"assert strata.cli.__file__.startswith({str(site)!r}), strata.cli.__file__; strata.cli.main()")
    ran = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "simulate" in ran.stdout and "serve" in ran.stdout

