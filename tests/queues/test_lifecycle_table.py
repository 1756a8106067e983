"""The request lifecycle is named once (queues/lifecycle.py); the Lua scripts spell its values.
Read every script: the moves it declares are exactly the table's for it, and every status it
writes or compares is one of RequestStatus and belongs to a move it declares."""

from __future__ import annotations

import re

import pytest

from queues import scripts
from queues.lifecycle import TRANSITIONS, RequestStatus

VALUES = {s.value for s in RequestStatus}


def declared_moves(name: str) -> set[tuple[RequestStatus | None, RequestStatus]]:
    header = re.search(r"^Moves: (.+)$", scripts.source(name), re.M)
    assert header, f"{name}.lua declares no Moves: line"
    moves = set()
    for move in header.group(1).split(","):
        old, new = (part.strip() for part in move.split("->"))
        moves.add((None if old == "new" else RequestStatus(old), RequestStatus(new)))
    return moves


def statuses_in_code(name: str) -> set[str]:
    """Status values the script's code (not its header) writes or compares."""
    code = scripts.source(name).split("]]", 1)[1]
    written = re.findall(r"'HSET',[^\n]*?'status',\s*'(\w+)'", code)
    compared = re.findall(r"status'?\)?\s*[~=]=\s*'(\w+)'", code)
    closed = re.findall(r"close\([^)]*?'(\w+)'", code)  # close(..., '<status>', ...) in _lib.lua
    # _lib.lua's overdue() compares with 'waiting' and expire() writes 'expired'
    lib = {"waiting"} if re.search(r"\boverdue\(", code) else set()
    lib |= {"expired"} if re.search(r"\bexpire\(", code) else set()
    return set(written) | set(compared) | set(closed) | lib


@pytest.mark.parametrize("name", scripts.REQUEST_SCRIPTS)
def test_each_script_declares_exactly_its_moves_in_the_table(name):
    table = {(old, new) for old, new, script in TRANSITIONS if script == name}
    if name == "report":
        assert table == set() and "Moves:" not in scripts.source(name)  # fenced writes, no move
        return
    assert declared_moves(name) == table


@pytest.mark.parametrize("name", scripts.REQUEST_SCRIPTS)
def test_every_status_a_script_touches_is_a_request_status_of_its_moves(name):
    seen = statuses_in_code(name)
    assert seen <= VALUES, f"{name}.lua spells statuses not in RequestStatus: {seen - VALUES}"
    moves = {(old, new) for old, new, script in TRANSITIONS if script == name}
    allowed = {s.value for move in moves for s in move if s is not None} | {"running"}  # the fence checks it
    assert seen <= allowed, f"{name}.lua touches {seen - allowed} outside its moves"


def test_the_scripts_touch_statuses_at_all():
    """The reading above must find something, or it proves nothing."""
    assert statuses_in_code("requeue") >= {"running", "waiting", "failed", "cancelled"}
    assert statuses_in_code("claim") == {"running", "waiting", "expired"}
    assert statuses_in_code("expire") == {"waiting", "expired"}
    assert statuses_in_code("cancel") >= {"waiting", "cancelled"}
