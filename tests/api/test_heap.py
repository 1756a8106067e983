"""The API process freezes what its startup built (`create_app(freeze_heap=True)`, what `run`
passes): a full garbage collection never walks the app's long-lived objects while streams wait.
Apps made by tests leave the heap alone."""

from __future__ import annotations

import gc

import pytest

from api.app import create_app
from api.settings import ApiSettings
from tests.helpers.api import MODEL, FakeTokenizer
from tests.helpers.http import serve_app


@pytest.mark.parametrize("freeze", [False, True])
def test_startup_freezes_the_heap_only_when_asked(redis_url, freeze):
    gc.unfreeze()  # this test process's heap as the collector left it
    try:
        app = create_app(ApiSettings(redis_url=redis_url, served_model_name=MODEL, ctx=128),
                         tokenizer=FakeTokenizer(), freeze_heap=freeze)
        with serve_app(app):
            frozen = gc.get_freeze_count()
        assert (frozen > 0) == freeze, frozen
    finally:
        gc.unfreeze()
