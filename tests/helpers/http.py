"""A real uvicorn server for an app, and the server-sent events a client reads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from queues.server import free_port


@contextmanager
def serve_app(app) -> Iterator[str]:  # noqa: ANN001 - a FastAPI app
    """A real uvicorn server for `app` on a free loopback port, in a thread; yields its base URL."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def sse(lines) -> Iterator[dict]:  # noqa: ANN001 - httpx's line iterator
    """Each SSE event a client reads, as {"id": ..., "data": ...}, read lazily; comments skipped."""
    current: dict = {}
    for line in lines:
        if line == "":
            if current:
                yield current
            current = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            current[name] = value
