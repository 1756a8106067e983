"""The batch worker stops when told, whatever its command listener is doing."""

from __future__ import annotations

import threading
import time

import redis

from batches.worker import batch_rq_worker


def test_a_stop_right_after_the_listener_read_its_unsubscribe_does_not_wait_for_a_minute(redis_url):
    """RQ's teardown unsubscribes its command listener, then joins its thread. A listener that
    has already read the unsubscribe waits for a subscription again, for as long as its wait, and
    redis-py joins it with no bound: with RQ's 60 s a SIGTERM landing there kept the worker up to
    a minute (`strata serve` killed it at 20 s). The batch worker's listener waits
    `LISTEN_WAIT_S` (0.5 s), so the join ends well within 10 s."""
    with redis.Redis.from_url(redis_url) as client:
        worker = batch_rq_worker(client)
        worker.subscribe()
        assert worker.pubsub.subscribed
        worker.pubsub.unsubscribe()
        deadline = time.monotonic() + 10
        while worker.pubsub.subscribed:  # the listener read the unsubscribe: it waits for a subscription
            assert time.monotonic() < deadline, "the listener never read its unsubscribe"
            time.sleep(0.01)
        teardown = threading.Thread(target=worker.unsubscribe, daemon=True)  # what RQ's teardown calls
        teardown.start()
        teardown.join(10)
        assert not teardown.is_alive(), "the worker's stop waited on its command listener"
