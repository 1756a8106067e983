"""A batch's status moves only along BatchStatus's transitions, atomically in Redis."""

from __future__ import annotations

import pytest

from queues.batches import BatchStatus, BatchStore

S = BatchStatus


def new_batch(redis_client) -> BatchStore:  # noqa: ANN001
    store = BatchStore(redis_client)
    store.create({"id": "batch_1", "status": S.VALIDATING, "created_at": 1, "total": 0}, [])
    return store


def test_a_batch_runs_to_completed_and_leaves_the_active_set(redis_client):
    store = new_batch(redis_client)
    assert store.active() == ["batch_1"]
    for was, to in ((S.VALIDATING, S.IN_PROGRESS), (S.IN_PROGRESS, S.FINALIZING), (S.FINALIZING, S.COMPLETED)):
        assert store.advance("batch_1", (was,), to, f"{to}_at", now_s=7) is to
    assert store.status("batch_1") is S.COMPLETED and store.get("batch_1")["completed_at"] == "7"
    assert store.active() == []


def test_a_move_from_another_status_leaves_the_batch_as_it_is(redis_client):
    store = new_batch(redis_client)
    assert store.advance("batch_1", (S.IN_PROGRESS,), S.FINALIZING) is S.VALIDATING
    assert store.advance("batch_1", (S.VALIDATING, S.IN_PROGRESS), S.CANCELLING) is S.CANCELLING
    assert store.advance("batch_1", (S.VALIDATING,), S.IN_PROGRESS) is S.CANCELLING
    assert store.active() == ["batch_1"]


def test_a_move_no_batch_makes_is_refused_before_redis_is_touched(redis_client):
    store = new_batch(redis_client)
    with pytest.raises(ValueError, match="completed->in_progress"):
        store.advance("batch_1", (S.COMPLETED,), S.IN_PROGRESS)
    assert store.status("batch_1") is S.VALIDATING


def test_the_docs_table_lists_exactly_the_moves_a_batch_makes():
    from pathlib import Path

    from queues.batches import TRANSITIONS

    lines = (Path(__file__).resolve().parents[2] / "docs" / "batches.md").read_text().splitlines()
    start = lines.index("| from | to | by |") + 2
    table = lines[start: lines.index("", start)]
    rows = [line.split("|")[1:3] for line in table]
    assert {(S(was.strip(" `")), S(to.strip(" `"))) for was, to in rows} == TRANSITIONS
    assert len(rows) == len(TRANSITIONS)


def test_a_batch_that_ended_but_stayed_in_the_active_set_is_dropped_by_the_sweep(redis_client):
    """The active set is another Cluster slot than the batch, so it changes after the status: a
    process that died in between leaves an ended batch listed, and the sweep drops it unrun."""
    from batches.worker import sweep
    from queues.keys import batches_active_key

    store = new_batch(redis_client)
    store.advance("batch_1", (S.VALIDATING,), S.CANCELLING)
    store.advance("batch_1", (S.CANCELLING,), S.CANCELLED)
    redis_client.sadd(batches_active_key(), "batch_1")  # as if the SREM never ran
    assert store.active() == ["batch_1"]
    assert sweep(redis_client) == []
    assert store.active() == [] and store.status("batch_1") is S.CANCELLED
