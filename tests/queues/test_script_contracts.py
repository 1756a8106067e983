"""The Python↔Lua contract of every script, read from both sides: the names a script gives its
KEYS and ARGV in its first lines are the names its builder in queues/scripts.py fills, in the
same order; its result constants are its result enum's; no line below the names says KEYS[n]
or ARGV[n]; and the cancel event is spelled once, in _lib.lua."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from queues import scripts
from queues.keys import Keys
from queues.records import QueuedRequest

LUA = Path(scripts.__file__).parent / "lua"
NAMES = sorted(p.stem for p in LUA.glob("*.lua") if p.stem != "_lib")
K = Keys("m")
REQUEST = QueuedRequest(id="r", priority=1, prompt=[1, 2], max_tokens=4)

# One call of each builder, with the variable part each script reads past its named entries.
CALLS = {
    "enqueue": scripts.enqueue(K, REQUEST, 0, 0, 0, {"key_name": "k"}, 1000),
    "head": scripts.head(K, 4),
    "peers": scripts.peers(K, 0, "w"),
    "claim": scripts.claim(K, "000000000001:r", "r", "w", 0, 10, 60),
    "report": scripts.report(K, "w", 0, 10, [scripts.Reported("r", 1, 2, 0, True, None, 1, [{"type": "token", "text": "a", "ids": "5"}])]),
    "finish": scripts.finish(K, "r", "w", 1, "finished", 0, 60, 2, "stop", "10,20", {"type": "done"}),
    "requeue": scripts.requeue(K, "r", 0, 3, 60),
    "cancel": scripts.cancel(K, "r", 0, 60),
    "expire": scripts.expire(K, "r", 0, 60),
    "batch_advance": scripts.batch_advance("b", ["validating"], "in_progress", "", 0),
    "batch_lease": scripts.batch_lease("b", "t", 1000),
    "batch_result": scripts.batch_result("b", 0, "{}", "completed"),
}


def named(name: str, table: str) -> list[str]:
    """The local names given to KEYS[1..n] (or ARGV), checked to be numbered 1..n in order."""
    names: list[str] = []
    for left, right in re.findall(rf"^local ([\w, ]+) = ((?:{table}\[\d+\](?:, )?)+)$", scripts.source(name), re.M):
        locals_ = [n.strip() for n in left.split(",")]
        numbers = [int(n) for n in re.findall(rf"{table}\[(\d+)\]", right)]
        assert len(locals_) == len(numbers), f"{name}.lua: {left} = {right}"
        assert numbers == list(range(len(names) + 1, len(names) + 1 + len(numbers))), f"{name}.lua numbers {table}"
        names += locals_
    return names


def body(name: str) -> str:
    """The script below its header comment and its named entries."""
    code = scripts.source(name).split("]]", 1)[1]
    return "\n".join(line for line in code.splitlines() if not re.match(r"^local [\w, ]+ = (KEYS|ARGV)\[", line))


def constants(name: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for left, right in re.findall(r"^local ([A-Z_, ]+) = ([\d, ]+?)\s*(?:--.*)?$", scripts.source(name), re.M):
        found.update(zip((n.strip() for n in left.split(",")), (int(v) for v in right.split(","))))
    return found


def test_every_script_has_a_builder_and_a_result_entry():
    assert sorted(CALLS) == NAMES == sorted(scripts.RESULTS)
    assert sorted(scripts.REQUEST_SCRIPTS + scripts.READ_SCRIPTS + scripts.BATCH_SCRIPTS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_the_builder_fills_the_names_the_script_gives_its_keys_and_args(name):
    call = CALLS[name]
    assert call.script == name
    assert list(call.keys) == named(name, "KEYS")
    assert list(call.args) == named(name, "ARGV")


@pytest.mark.parametrize("name", NAMES)
def test_no_line_below_the_names_says_a_bare_position(name):
    assert re.findall(r"(?:KEYS|ARGV)\[\d+\]", body(name)) == []


@pytest.mark.parametrize("name", [n for n in NAMES if scripts.RESULTS[n] is not None])
def test_the_result_constants_of_a_script_are_its_enum(name):
    enum_ = scripts.RESULTS[name]
    results = {k: v for k, v in constants(name).items() if k not in ("EXTRA", "EVENT", "REQUESTS")}
    assert results == {member.name: member.value for member in enum_}
    assert all(re.search(rf"\b{n}\b", body(name)) for n in results)  # and the script answers them


def test_the_offsets_of_the_variable_parts_follow_the_named_args():
    """enqueue's extra fields, finish's event and report's requests start right after the names."""
    assert constants("enqueue")["EXTRA"] == len(named("enqueue", "ARGV")) + 1
    assert constants("finish")["EVENT"] == len(named("finish", "ARGV")) + 1
    assert constants("report")["REQUESTS"] == len(named("report", "ARGV")) + 1


def test_the_cancel_event_is_spelled_once():
    spelled = [p.name for p in LUA.glob("*.lua") if "'message', 'cancelled'" in p.read_text()]
    assert spelled == ["_lib.lua"]
    assert all("cancelled_event()" in scripts.source(n) for n in ("cancel", "finish", "requeue"))
    assert all(n in scripts.WITH_LIB for n in ("cancel", "finish", "requeue"))
