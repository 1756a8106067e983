"""Every Redis key Strata uses, and only here. All keys of one model share the hash tag
`{model}` so each Lua script touches one Redis Cluster slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

PREFIX = "strata"


class Member(NamedTuple):
    """A member of the waiting set, `<seq>:<id>` (enqueue.lua writes it: the arrival number,
    zero-padded so that equal scores sort by arrival, then the request id)."""

    seq: int
    id: str

    @classmethod
    def parse(cls, member: str) -> "Member":
        seq, _, request_id = member.partition(":")
        return cls(int(seq), request_id)


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
        """Sorted set of `<seq>:<id>` members, score = -priority (with aging:
        (enqueued - epoch)/aging_s - priority): ZRANGE lists service order."""
        return f"{self.base}:waiting"

    @property
    def policy(self) -> str:
        """Hash of the queue's own policy, written by the workers: aging_s (absent: no aging) and
        aging_epoch_ms (the zero of aged scores). enqueue.lua reads it, so every API replica and
        batch job scores the same way."""
        return f"{self.base}:policy"

    @property
    def deadlines(self) -> str:
        """Sorted set of waiting request ids that gave a queue_timeout, score = the deadline (ms)
        by which a worker must claim them, else they expire."""
        return f"{self.base}:deadlines"

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

    def wake_worker(self, worker_id: str) -> str:
        """List one worker blocks on beside `wake`: another worker that leaves it the head whose
        prefix it holds pushes here (short TTL), so it claims it at once instead of after a nap."""
        return f"{self.base}:wake:{worker_id}"

    @property
    def workers(self) -> str:
        """Sorted set: worker id -> last heartbeat (ms)."""
        return f"{self.base}:workers"

    @property
    def idle(self) -> str:
        """Sorted set: workers with a free slot and free lines -> when they said so (ms). A newcomer
        goes to one of them rather than making a read elsewhere give way."""
        return f"{self.base}:idle"

    @property
    def metrics(self) -> str:
        """Hash of counters and histogram buckets by priority, written when a request ends or a
        read gives way (queues/metrics.py names its fields); /metrics reads it."""
        return f"{self.base}:metrics"

    def req(self, request_id: str) -> str:
        return f"{self.base}:req:{request_id}"

    def out(self, request_id: str) -> str:
        return f"{self.base}:out:{request_id}"

    def worker(self, worker_id: str) -> str:
        """Hash with a short TTL: what the worker publishes about itself (queues/worker_state.py),
        among it `prefixes`, the affinity keys of the prompt prefixes its KV cache holds."""
        return f"{self.base}:worker:{worker_id}"


# ---- batches and files (OpenAI Batch API) --------------------------------------------------
# Batch-level keys are not per model: a batch's own keys share the hash tag `{<batch id>}` so
# its Lua scripts touch one Cluster slot. Each line's request lives under its model's keys,
# exactly as an interactive one (see Keys.req / Keys.out).


def batch_key(batch_id: str, prefix: str = PREFIX) -> str:
    """Hash: the batch object (status, endpoint, file ids, counts, timestamps, priority, model)."""
    return f"{prefix}:batch:{{{batch_id}}}"


def batch_lines_key(batch_id: str, prefix: str = PREFIX) -> str:
    """Hash: line number -> the line prepared at creation (custom_id + request, or its error)."""
    return f"{prefix}:batch:{{{batch_id}}}:lines"


def batch_results_key(batch_id: str, prefix: str = PREFIX) -> str:
    """Hash: line number -> its output/error file line (JSON). Written once per line (HSETNX)."""
    return f"{prefix}:batch:{{{batch_id}}}:results"


def batch_lease_key(batch_id: str, prefix: str = PREFIX) -> str:
    """String with a TTL: the token of the RQ job running the batch now. Absent: nobody runs it."""
    return f"{prefix}:batch:{{{batch_id}}}:lease"


def batches_key(prefix: str = PREFIX) -> str:
    """Sorted set: batch id -> created_at (s). GET /v1/batches lists it newest first."""
    return f"{prefix}:batches"


def batches_active_key(prefix: str = PREFIX) -> str:
    """Set of batch ids not yet in a final status: what `strata batch-worker` watches."""
    return f"{prefix}:batches:active"


def file_key(file_id: str, prefix: str = PREFIX) -> str:
    """Hash: a file's metadata (bytes, created_at, filename, purpose)."""
    return f"{prefix}:file:{{{file_id}}}"


def file_content_key(file_id: str, prefix: str = PREFIX) -> str:
    """String: a file's bytes."""
    return f"{prefix}:file:{{{file_id}}}:content"


def files_key(prefix: str = PREFIX) -> str:
    """Sorted set: file id -> created_at (s)."""
    return f"{prefix}:files"
