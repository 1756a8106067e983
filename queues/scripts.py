"""The Lua scripts, one per state change, and their contracts with Python.

Each script (queues/lua/<name>.lua) names its KEYS and ARGV in its first lines
(`local waiting, req = KEYS[1], KEYS[2]`) and its results (`local LOST, HELD = 0, 1`). Here,
beside it, one builder per script takes those same names and returns the `Call`, and one enum
per script reads its result. tests/queues/test_script_contracts.py holds the two sides to each
other: same names in the same order, same result names and values."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Sequence

import redis.cluster
import redis.exceptions

from queues.affinity import affinity_key
from queues.keys import Keys, batch_key, batch_lease_key, batch_results_key

# Lua has no import: the scripts that fence, end or cancel a request get _lib.lua in front.
REQUEST_SCRIPTS = ("enqueue", "claim", "report", "finish", "requeue", "cancel", "expire")
READ_SCRIPTS = ("head", "peers")  # no state change: a read that takes one round trip instead of two
WITH_LIB = ("claim", "report", "finish", "requeue", "expire", "cancel")
BATCH_SCRIPTS = ("batch_result", "batch_lease", "batch_advance")


def source(name: str) -> str:
    return resources.files("queues").joinpath("lua", f"{name}.lua").read_text()


def script_text(name: str) -> str:
    """What Redis runs: the script, after _lib.lua where it needs the shared functions."""
    return (source("_lib") + "\n" if name in WITH_LIB else "") + source(name)


def register(client, names: Sequence[str] = REQUEST_SCRIPTS + READ_SCRIPTS) -> dict:  # noqa: ANN001 - sync or asyncio client
    """Scripts bound to a client (sync or asyncio), by name; run them with `run`."""
    return {name: client.register_script(script_text(name)) for name in names}


@dataclass(frozen=True)
class Call:
    """One script call: KEYS and ARGV by the names the script gives them, in its order, then
    the variable part the script reads past its named entries."""

    script: str
    keys: dict[str, str]
    args: dict[str, Any]
    more_keys: list[str] = field(default_factory=list)
    more_args: list[Any] = field(default_factory=list)


def run(registered: dict, call: Call) -> Any:  # noqa: ANN401 - the reply, or an awaitable of it
    """Run `call` with scripts from `register` (awaitable with an asyncio client)."""
    return registered[call.script](keys=[*call.keys.values(), *call.more_keys],
                                   args=[*call.args.values(), *call.more_args])


def run_all(client: redis.Redis, registered: dict, calls: Sequence[Call]) -> list[Any]:
    """Run `calls` in order in one round trip (a pipeline of EVALSHA, not a transaction: each
    script is atomic on its own, as when run one by one), replies in order; a reply that is an
    error is raised. redis-py's own pipelined scripts ask SCRIPT EXISTS first, a round trip more
    per step; here a script Redis lost (a restart) answers NOSCRIPT without having run, and only
    those calls run again, in order, once loaded."""
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    node = _node_of(client, calls)
    for attempt in (0, 1):
        pipe = node.pipeline(transaction=False)
        for i in todo:
            call, script = calls[i], registered[calls[i].script]
            keys, args = [*call.keys.values(), *call.more_keys], [*call.args.values(), *call.more_args]
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        answered = pipe.execute(raise_on_error=False)
        missing = []
        for i, reply in zip(todo, answered):
            if isinstance(reply, redis.exceptions.NoScriptError) and attempt == 0:
                missing.append(i)
            elif node is not client and _moved(reply):  # the slot moved off that node: the cluster routes it
                replies[i] = run(registered, calls[i])
            elif isinstance(reply, Exception):
                raise reply
            else:
                replies[i] = reply
        if not missing:
            break
        for name in {calls[i].script for i in missing}:
            registered[name].sha = client.script_load(registered[name].script)
        todo = missing
    return replies


def _node_of(client: Any, calls: Sequence[Call]) -> Any:  # noqa: ANN401 - a client of either kind
    """The client to pipeline on. redis-py's cluster pipeline refuses EVALSHA, but every key of a
    model carries its hash tag ({model}, queues/keys.py), so a step's calls all live on the node
    that serves the first key's slot: pipelined on that node's own connection."""
    if not isinstance(client, redis.cluster.RedisCluster) or not calls:
        return client
    first = calls[0]
    key = next(iter([*first.keys.values(), *first.more_keys]), None)
    if key is None:
        return client
    return client.get_redis_connection(client.get_node_from_key(key))


def _moved(reply: object) -> bool:
    return isinstance(reply, redis.exceptions.ResponseError) and str(reply).startswith(("MOVED", "ASK"))


def _blank(value: object | None) -> object:
    return "" if value is None else value


def _pairs(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


# ---- enqueue.lua ------------------------------------------------------------------------------


class QueueError(enum.Enum):
    QUEUE_FULL = "QUEUE_FULL"
    DUPLICATE = "DUPLICATE"




class QueueRefused(Exception):
    def __init__(self, code: QueueError) -> None:
        super().__init__(code.value)
        self.code = code


def refused(error: redis.exceptions.ResponseError) -> QueueRefused | None:
    text = str(error)
    for code in QueueError:
        if text.startswith(code.value):
            return QueueRefused(code)
    return None


def enqueue(keys: Keys, request, now_ms: int, max_waiting: int, hard_limit: int,  # noqa: ANN001 - a QueuedRequest
            fields: dict[str, str] | None = None, queue_timeout_ms: int | None = None) -> Call:
    """One request joins the queue (the API's, the batch job's and the simulator's enqueue).
    `queue_timeout_ms`: not claimed within it, the request expires (None: it waits as long as
    it takes). `fields`: more fields of the request hash (e.g. key_name). The prompt's affinity
    key (queues/affinity.py: a hash of its first whole blocks, up to 256 tokens) goes on the hash
    as `affinity`, computed here once, where every enqueuer has the token ids."""
    key = affinity_key(request.prompt)
    return Call(
        "enqueue",
        keys=dict(seq_counter=keys.seq, waiting=keys.waiting, req=keys.req(request.id), wake=keys.wake,
                  deadlines=keys.deadlines, policy=keys.policy),
        args=dict(id=request.id, priority=request.priority, prompt="[" + ",".join(map(str, request.prompt)) + "]",
                  prompt_tokens=len(request.prompt), params=request.params_json(), now=now_ms,
                  max_ahead=max_waiting, hard_limit=hard_limit,
                  queue_deadline="" if queue_timeout_ms is None else now_ms + queue_timeout_ms),
        more_args=_pairs({**(fields or {}), **({"n": str(request.n)} if request.n > 1 else {}),
                          **({"affinity": key} if key else {})}),
    )


# ---- claim.lua --------------------------------------------------------------------------------


class ClaimResult(enum.IntEnum):
    GONE = 0  # another worker took it first
    CLAIMED = 1
    EXPIRED = 2  # its queue deadline had passed: it expired instead


def head(keys: Keys, count: int) -> Call:
    return Call("head", keys=dict(waiting=keys.waiting), args=dict(count=count, req_prefix=keys.req("")))


def peers(keys: Keys, since_ms: int, worker: str) -> Call:
    return Call("peers", keys=dict(idle=keys.idle),
                args=dict(since=since_ms, worker_prefix=keys.worker(""), self_id=worker))


def claim(keys: Keys, member: str, request_id: str, worker: str, now_ms: int, lease_deadline_ms: int,
          retention_s: int) -> Call:
    return Call(
        "claim",
        keys=dict(waiting=keys.waiting, running=keys.running, req=keys.req(request_id), claims=keys.claims,
                  deadlines=keys.deadlines, out=keys.out(request_id), metrics=keys.metrics),
        args=dict(member=member, id=request_id, worker=worker, now=now_ms, lease_deadline=lease_deadline_ms,
                  ttl=retention_s),
    )


# ---- report.lua -------------------------------------------------------------------------------


class ReportResult(enum.IntEnum):
    LOST = 0  # the worker no longer holds the claim: it drops the request, writes nothing more
    HELD = 1
    CANCEL_ASKED = 2  # held, and its client asked to cancel


@dataclass(frozen=True)
class Reported:
    """One request's entry in a report (queues/claims.py `Held` builds it)."""

    id: str
    claim_seq: int
    generated: int
    slot: int | None
    first_token: bool
    gave_way_to: str | None
    priority: int
    events: list[dict[str, str]]  # this step's stream entries, each its fields (queues/records.py `event_fields`)
    cached_tokens: int | None = None  # claimed this step: its prompt tokens found in the KV pool


def report(keys: Keys, worker: str, now_ms: int, lease_deadline_ms: int, requests: Sequence[Reported]) -> Call:
    more_keys: list[str] = []
    more_args: list = []
    for r in requests:
        more_keys += [keys.req(r.id), keys.out(r.id)]
        more_args += [r.id, r.claim_seq, r.generated, _blank(r.slot), int(r.first_token), _blank(r.gave_way_to),
                      r.priority, _blank(r.cached_tokens), len(r.events)]
        for fields in r.events:
            more_args += [len(fields), *_pairs(fields)]
    return Call("report", keys=dict(running=keys.running, metrics=keys.metrics),
                args=dict(worker=worker, now=now_ms, lease_deadline=lease_deadline_ms, n=len(requests)),
                more_keys=more_keys, more_args=more_args)


# ---- finish.lua -------------------------------------------------------------------------------


class FinishResult(enum.IntEnum):
    LOST = 0  # this worker no longer holds that claim: nothing was written
    ENDED = 1


def finish(keys: Keys, request_id: str, worker: str, claim_seq: int, status: str, now_ms: int, retention_s: int,
           completion_tokens: int, reason: str, bounds: str, event: dict[str, str] | None) -> Call:
    """`event`: the last stream entry's fields (None for a cancel: finish.lua writes the cancel
    event)."""
    return Call(
        "finish",
        keys=dict(running=keys.running, req=keys.req(request_id), out=keys.out(request_id), metrics=keys.metrics),
        args=dict(id=request_id, worker=worker, claim_seq=claim_seq, status=status, now=now_ms, ttl=retention_s,
                  completion_tokens=completion_tokens, reason=reason, bounds=bounds),
        more_args=_pairs(event or {}),
    )


# ---- requeue.lua ------------------------------------------------------------------------------


class RequeueResult(enum.IntEnum):
    NOTHING = 0  # lease renewed, not that owner, or already ended
    REQUEUED = 1
    ENDED = 2  # failed (worker_lost) or cancelled


def requeue(keys: Keys, request_id: str, now_ms: int, most_lost: int, retention_s: int, owner: str | None = None,
            claim_seq: int | None = None, lost: bool = True) -> Call:
    """`owner` None: only if its lease ran out; else the worker that must hold it (and
    `claim_seq`, None: any of its claims)."""
    return Call(
        "requeue",
        keys=dict(running=keys.running, waiting=keys.waiting, req=keys.req(request_id), out=keys.out(request_id),
                  metrics=keys.metrics),
        args=dict(id=request_id, now=now_ms, most_lost=most_lost, ttl=retention_s, owner=_blank(owner),
                  claim_seq=_blank(claim_seq), lost=int(lost)),
    )


# ---- cancel.lua (its result: the RequestStatus the request had, None when unknown) -----------


def cancel(keys: Keys, request_id: str, now_ms: int, retention_s: int) -> Call:
    return Call(
        "cancel",
        keys=dict(waiting=keys.waiting, req=keys.req(request_id), out=keys.out(request_id), deadlines=keys.deadlines),
        args=dict(now=now_ms, ttl=retention_s, id=request_id),
    )


# ---- expire.lua -------------------------------------------------------------------------------


class ExpireResult(enum.IntEnum):
    NOT_DUE = 0  # not yet due, or no longer waiting for its first claim
    EXPIRED = 1


def expire(keys: Keys, request_id: str, now_ms: int, retention_s: int) -> Call:
    return Call(
        "expire",
        keys=dict(waiting=keys.waiting, deadlines=keys.deadlines, req=keys.req(request_id), out=keys.out(request_id),
                  metrics=keys.metrics),
        args=dict(id=request_id, now=now_ms, ttl=retention_s),
    )


# ---- batch_advance.lua (its result: a BatchStatus; error NOT_FOUND) ---------------------------


def batch_advance(batch_id: str, from_statuses: Sequence[str], to: str, stamp: str, now_s: int) -> Call:
    return Call("batch_advance", keys=dict(batch=batch_key(batch_id)),
                args=dict(id=batch_id, from_statuses=" ".join(from_statuses), to=to, stamp=stamp, now=now_s))


# ---- batch_lease.lua --------------------------------------------------------------------------


class LeaseResult(enum.IntEnum):
    TAKEN = 0  # another job's token holds it
    HELD = 1


def batch_lease(batch_id: str, token: str, lease_ms: int) -> Call:
    """`lease_ms` 0 releases it."""
    return Call("batch_lease", keys=dict(lease=batch_lease_key(batch_id)), args=dict(token=token, ms=lease_ms))


# ---- batch_result.lua -------------------------------------------------------------------------


class LineResult(enum.IntEnum):
    ALREADY = 0  # the line had a result already
    RECORDED = 1


def batch_result(batch_id: str, line: int, result: str, count: str) -> Call:
    """`count`: 'completed', 'failed' or '' (a line the batch never ran)."""
    return Call("batch_result", keys=dict(results=batch_results_key(batch_id), batch=batch_key(batch_id)),
                args=dict(line=line, result=result, count=count))


# Every script's result enum (None: it answers a status, see above).
RESULTS: dict[str, type[enum.IntEnum] | None] = {
    "enqueue": None, "head": None, "peers": None, "claim": ClaimResult, "report": ReportResult, "finish": FinishResult,
    "requeue": RequeueResult, "cancel": None, "expire": ExpireResult, "batch_advance": None,
    "batch_lease": LeaseResult, "batch_result": LineResult,
}
