"""Every file, test, module attribute and method the docs name exists: README.md and docs/*.md
are read for file paths (`workers/scheduler.py`, `queues/lua/claim.lua`,
`tests/x/test_y.py::test_z`), `module.function(...)` where module is one of ours (`scheduler.free_slot(...)`,
`engine.load_engine()`) and `Class.method` where Class is one of ours (`Engine.begin`). Read from
the source (ast), nothing imported."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "batches", "bench", "engine", "queues", "shapes", "simulate", "strata", "workers", "tests")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:%s|docs|monitoring)/[\w/.-]*\w)(?:::(\w+))?" % "|".join(PACKAGES))
SUFFIXES = {"py", "lua", "md", "json", "jsonl", "yaml", "yml", "toml", "cpp", "sh", "txt", "png", "gguf", "whl"}
DOTTED = re.compile(r"`((?:[A-Za-z_]\w*\.)*)([A-Za-z_]\w*)\.([A-Za-z_]\w*)(\([^`]*\))?`")


def _names() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """module basename (and dotted path) -> names it defines; class name -> its attributes."""
    modules: dict[str, set[str]] = defaultdict(set)
    classes: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            keys = {path.stem, dotted} if path.stem != "__init__" else {path.parent.name, dotted[: -len(".__init__")]}
            defined = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    defined |= {t.id for t in targets if isinstance(t, ast.Name)}
                elif isinstance(node, ast.ImportFrom):
                    defined |= {a.asname or a.name for a in node.names}
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            defined.add(item.name)  # `engine.decode`: a method of what the module defines
                            classes[node.name].add(item.name)
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            classes[node.name].add(item.target.id)
                        elif isinstance(item, ast.Assign):
                            classes[node.name] |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                    for sub in ast.walk(node):  # instance attributes: self.x = ... in its methods
                        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                            sub, ast.AnnAssign) else []
                        classes[node.name] |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                                               and isinstance(t.value, ast.Name) and t.value.id == "self"}
            for key in keys:
                modules[key] |= defined
    return modules, classes


MODULES, CLASSES = _names()


def named_in(doc: Path) -> tuple[set[tuple[str, str | None]], set[tuple[str, str]]]:
    text = doc.read_text()
    paths = {(m.group(1).rstrip("."), m.group(2)) for m in PATH.finditer(text)}
    # `module.function(...)` (called: a bare `rope.freq_base_swa` may be a GGUF key) or `Class.method`
    dotted = {(m.group(2), m.group(3)) for m in DOTTED.finditer(text)
              if m.group(3) not in SUFFIXES and (not m.group(1) or m.group(1).split(".")[0] in PACKAGES)
              and (m.group(4) or m.group(2)[:1].isupper())}
    return paths, dotted


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_and_test_a_doc_names_exists(doc):
    paths, _ = named_in(doc)
    missing = []
    for path, test in sorted(paths, key=str):
        target = ROOT / path
        if "*" in path or path.endswith("/"):
            continue
        if not target.exists():
            missing.append(path)
        elif test and not re.search(rf"^\s*(?:async )?def {test}\(", target.read_text(), re.M):
            missing.append(f"{path}::{test}")
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_function_and_method_a_doc_names_exists(doc):
    _, dotted = named_in(doc)
    missing = [f"{owner}.{name}" for owner, name in sorted(dotted)
               if (owner in MODULES and owner not in CLASSES and name not in MODULES[owner]
                   and f"{owner}.{name}" not in MODULES
                   and name not in CLASSES.get(owner.capitalize(), ()))  # `engine.decode`: an Engine's
               or (owner in CLASSES and owner not in MODULES and name not in CLASSES[owner])]
    assert missing == []


def test_the_reading_finds_names_at_all():
    """It must find what the design page names, or it proves nothing."""
    paths, dotted = named_in(ROOT / "docs" / "design.md")
    assert ("workers/scheduler.py", None) in paths and ("queues/keys.py", None) in paths
    assert ("scheduler", "next_read") in dotted
