"""Another commit's code beside the working tree's, for `--baseline REF` in the benches."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def checkout(ref: str | None) -> Iterator[Path | None]:
    """A temporary git worktree of `ref` (None: no worktree), removed afterwards."""
    if ref is None:
        yield None
        return
    worktree = Path(tempfile.mkdtemp(prefix="strata-baseline-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), ref],
                   check=True, capture_output=True)
    try:
        yield worktree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], capture_output=True)


def env_with_first(tree: str | Path) -> dict[str, str]:
    """The environment with `tree`'s packages first on the path, and whatever the path held
    after them (packages installed with `pip --target`, as on a lent GPU machine)."""
    path = [str(tree), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
