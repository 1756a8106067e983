"""Every Redis key Strata uses, and only here. All keys of one model share the hash tag
`{model}` so each Lua script touches one Redis Cluster slot."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "strata"


def models_key(prefix: str = PREFIX) -> str:
    """Sorted set: model name -> last worker heartbeat (ms). Lists what is served."""
    return f"{prefix}:models"


@dataclass(frozen=True)
class Keys:
    model: str
    prefix: str = PREFIX

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.model}}}"

    @property
    def waiting(self) -> str:
        """Sorted set of `<seq>:<id>` members, score = -priority: ZRANGE lists service order."""
        return f"{self.base}:waiting"

    @property
    def running(self) -> str:
        """Sorted set of claimed request ids, score = lease deadline (ms)."""
        return f"{self.base}:running"

    @property
    def seq(self) -> str:
        """Counter giving each request its arrival number."""
        return f"{self.base}:seq"

    @property
    def claims(self) -> str:
        """Counter of claims: a request's `claim_seq` says in which order it got a slot."""
        return f"{self.base}:claims"

    @property
    def wake(self) -> str:
        """List a worker blocks on while idle; enqueue pushes to it."""
        return f"{self.base}:wake"

    @property
    def workers(self) -> str:
        """Sorted set: worker id -> last heartbeat (ms)."""
        return f"{self.base}:workers"

    @property
    def idle(self) -> str:
        """Sorted set: workers with a free slot and free lines -> when they said so (ms). A newcomer
        goes to one of them rather than making a read elsewhere give way."""
        return f"{self.base}:idle"

    def req(self, request_id: str) -> str:
        return f"{self.base}:req:{request_id}"

    def out(self, request_id: str) -> str:
        return f"{self.base}:out:{request_id}"

    def worker(self, worker_id: str) -> str:
        return f"{self.base}:worker:{worker_id}"

    def cancel(self, worker_id: str) -> str:
        """Set of request ids a worker must drop at its next step."""
        return f"{self.base}:cancel:{worker_id}"
