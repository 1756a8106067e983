"""Cancelling a request whose client has gone, even while Redis is away: a cancel that cannot be
delivered now is kept and delivered once Redis answers again, so an abandoned request does not
run to its end ahead of the client's retry."""

from __future__ import annotations

import logging

import anyio

from queues.connect import UNAVAILABLE
from queues.intake import Intake

log = logging.getLogger("strata.api")


class Cancels:
    def __init__(self, intake: Intake, *, retry_s: float = 0.5) -> None:
        self.intake = intake
        self.retry_s = retry_s
        self.pending: set[str] = set()
        self._wake = anyio.Event()

    async def cancel(self, request_id: str) -> None:
        try:
            status = await self.intake.cancel(request_id)
            log.info("cancelled %s (was %s)", request_id, status or "unknown")
        except UNAVAILABLE:
            log.warning("could not cancel %s now (Redis unreachable); will deliver it later", request_id)
            self.pending.add(request_id)
            self._wake.set()

    async def deliver(self) -> None:
        """Runs for the app's lifetime: hands the kept cancels to Redis once it is back."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self.pending:
                for request_id in sorted(self.pending):
                    try:
                        await self.intake.cancel(request_id)
                    except UNAVAILABLE:
                        await anyio.sleep(self.retry_s)
                        break
                    self.pending.discard(request_id)
                    log.info("delivered the late cancel of %s", request_id)
