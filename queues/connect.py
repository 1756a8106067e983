"""One way for every process to reach Redis: clients that retry a command across a dropped
connection (Redis restarting), and a wait for a Redis that is still starting.

A Redis Cluster is selected by `--redis-cluster` (STRATA_REDIS_CLUSTER), or implied by a URL that
lists several nodes, `redis://[user:password@]host1:port1,host2:port2`: any one reachable node
suffices, the client learns the others. Every key of one model shares the hash tag `{model}` and
every Lua script is passed all its keys (queues/keys.py), so each script runs on one node."""

from __future__ import annotations

import logging
import time

import anyio
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

log = logging.getLogger("strata.redis")

# Redis is gone for now (restarting, network): the caller waits and tries again.
UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _options(retry: type) -> dict:
    return dict(
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        retry_on_error=list(UNAVAILABLE),
    )


def is_cluster(url: str, cluster: bool = False) -> bool:
    """The flag, or a URL listing several nodes."""
    return cluster or "," in url.partition("://")[2].partition("/")[0].rpartition("@")[2]


def cluster_nodes(url: str) -> tuple[str, list[redis.cluster.ClusterNode]]:
    """`redis://[auth@]h1:p1,h2:p2[/0][?opts]` -> the URL of its first node (credentials, TLS and
    options kept) and the other nodes, to start from."""
    scheme, _, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    auth, at, hosts = authority.rpartition("@")
    first, *others = [h.strip() for h in hosts.split(",") if h.strip()]
    nodes = []
    for node in others:
        host, _, port = node.rpartition(":")
        nodes.append(redis.cluster.ClusterNode(host or node, int(port) if host else 6379))
    return f"{scheme}://{auth}{at}{first}{slash}{tail}", nodes


def connect(url: str, *, cluster: bool = False, within_s: float = 20.0,
            decode_responses: bool = True) -> redis.Redis | redis.cluster.RedisCluster:
    """A synchronous client, once Redis answers (it may still be starting)."""
    deadline = time.monotonic() + within_s
    delay = 0.1
    while True:
        try:
            if is_cluster(url, cluster):  # learns the cluster's nodes and slots at once
                first, nodes = cluster_nodes(url)
                client = redis.cluster.RedisCluster.from_url(
                    first, startup_nodes=nodes, decode_responses=decode_responses, socket_connect_timeout=5,
                    retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3))
            else:
                client = redis.Redis.from_url(url, decode_responses=decode_responses, **_options(Retry))
            client.ping()
            return client
        except (*UNAVAILABLE, OSError, redis.exceptions.RedisClusterException):
            if time.monotonic() >= deadline:
                raise
            log.warning("waiting for Redis at %s", url)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


# An API process holds one connection per answer it is following (each waits in a blocking XREAD)
# plus those of requests being enqueued. redis-py's asyncio pool stops at 100 and then fails the
# command (MaxConnectionsError, a ConnectionError: it looked like Redis being down), so the 101st
# open stream broke. Redis itself accepts 10 000 clients by default. (The cluster client's
# pools, one per node, have the same limit of 100.)
ASYNC_MAX_CONNECTIONS = 10_000


def connect_async(url: str, *, cluster: bool = False) -> aioredis.Redis | aiocluster.RedisCluster:
    """An asyncio client; `await wait_until_up(client, s)` before relying on it."""
    if is_cluster(url, cluster):
        first, nodes = cluster_nodes(url)
        return aiocluster.RedisCluster.from_url(first, startup_nodes=nodes, max_connections=ASYNC_MAX_CONNECTIONS,
                                                **_options(AsyncRetry))
    return aioredis.Redis.from_url(url, max_connections=ASYNC_MAX_CONNECTIONS, **_options(AsyncRetry))


async def wait_until_up(client: aioredis.Redis, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    delay = 0.1
    while True:
        try:
            await client.ping()
            return
        except (*UNAVAILABLE, OSError, redis.exceptions.RedisClusterException):
            if time.monotonic() >= deadline:
                raise
            log.warning("waiting for Redis (%s)", client)
            await anyio.sleep(delay)
            delay = min(delay * 2, 2.0)
