"""Which Redis a process talks to: a REDIS_URL listing several nodes (or --redis-cluster) means
a Redis Cluster; RQ then needs a plain Redis of its own. The cluster itself is exercised end to
end in tests/e2e/test_cluster.py."""

from __future__ import annotations

import pytest

from batches.handoff import rq_url
from queues.connect import cluster_nodes, is_cluster


def test_several_nodes_or_the_flag_mean_a_cluster():
    assert is_cluster("redis://a:7000,b:7001/0")
    assert is_cluster("redis://a:7000", cluster=True)
    assert not is_cluster("redis://a:7000/0")
    assert not is_cluster("redis://user:p,w@a:7000/0")  # a comma in the password is not a node list


def test_the_first_node_keeps_credentials_tls_and_options_and_the_others_become_startup_nodes():
    first, others = cluster_nodes("rediss://user:secret@h1:7000,h2:7001, h3/0?socket_timeout=3")
    assert first == "rediss://user:secret@h1:7000/0?socket_timeout=3"
    assert [(n.host, n.port) for n in others] == [("h2", 7001), ("h3", 6379)]


def test_rq_gets_its_own_plain_redis_beside_a_cluster():
    assert rq_url("redis://r:6379/0", False, None) == "redis://r:6379/0"
    assert rq_url("redis://a:1,b:2", False, "redis://rq:6379/0") == "redis://rq:6379/0"
    with pytest.raises(ValueError, match="--rq-redis-url"):
        rq_url("redis://a:1,b:2", False, None)
    with pytest.raises(ValueError, match="--rq-redis-url"):
        rq_url("redis://a:1", True, None)
