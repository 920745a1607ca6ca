"""`--redis-cluster`: the node list, its defaults (WAIT 1, mode "cluster"), what it excludes, and
the client it makes."""

from __future__ import annotations

import argparse

import pytest

from common.redis_conn import ClusterClient, pooled_client, single_client
from common.redis_spec import RedisSpec, add_redis_arguments, parse_cluster_nodes, spec_from_args


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_redis_arguments(parser)
    return parser.parse_args(list(argv))


def test_parse_cluster_nodes() -> None:
    assert parse_cluster_nodes("a:7000, b ,[::1]:7001") == (("a", 7000), ("b", 6379), ("::1", 7001))
    for bad in ("", "a:x", "a:1,a:1"):
        with pytest.raises(ValueError, match="cluster node"):
            parse_cluster_nodes(bad)


def test_spec_from_args_with_a_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_REDIS_SENTINEL", raising=False)
    monkeypatch.delenv("PAGEDSERVE_REDIS_CLUSTER", raising=False)
    spec = spec_from_args(_args("--redis-cluster", "n1:7000,n2:7001", "--redis-password", "pw"))
    assert spec.cluster == (("n1", 7000), ("n2", 7001)) and spec.uses_cluster and not spec.uses_sentinel
    assert spec.mode == "cluster" and spec.replicas_to_wait == 1 and spec.password == "pw"
    assert spec.describe() == "cluster via n1:7000,n2:7001"
    assert spec_from_args(_args("--redis-url", "redis://h:1/0")).mode == "url"
    monkeypatch.setenv("PAGEDSERVE_REDIS_CLUSTER", "n3:7002")
    assert spec_from_args(_args()).cluster == (("n3", 7002),)
    with pytest.raises(ValueError, match="exclude"):
        spec_from_args(_args("--redis-cluster", "n1", "--redis-sentinel", "s1"))


async def test_a_cluster_spec_makes_cluster_clients() -> None:
    spec = RedisSpec(cluster=(("127.0.0.1", 1),))
    for client in (pooled_client(spec, 4, 1.0), single_client(spec)):
        assert isinstance(client, ClusterClient)  # nothing connects before the first command
        await client.aclose(close_connection_pool=True)
