"""`pagedserve switch-master --redis-cluster` on a real Redis Cluster (3 masters, a replica each,
on loopback): a cluster client writing into the moved master's slots all along loses none of its
acknowledged writes, every node then routes those slots to the replica and the old master is its
replica; `--model` moves the master of that model's request stream; a master without a replica
is refused; a failover that cannot happen (the master frozen, so the replica never gets its
offset) fails with status 1 and leaves the master serving; and the parsing of `CLUSTER NODES`."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from common.protocol import Keys
from pagedserve.launch.cluster_switch import parse_nodes
from tests.fixtures.redis_cluster import RedisClusterGroup


@pytest.fixture
def cluster() -> Iterator[RedisClusterGroup]:
    group = RedisClusterGroup(masters=3, replicas=1)
    try:
        yield group
    finally:
        group.stop()


def _client(group: RedisClusterGroup) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in group.addresses], socket_timeout=5)


def _routes(group: RedisClusterGroup, slot: int) -> set[int]:
    """The master port each live node's CLUSTER SLOTS gives for `slot`."""
    found = set()
    for port in group.live_ports():
        with redis.Redis(port=port, socket_timeout=5) as client:
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    found.add(int(master[1]))
    return found


def _role(port: int) -> str:
    with redis.Redis(port=port, socket_timeout=5) as client:
        return str(client.info("replication")["role"])


def test_switch_loses_no_acknowledged_write(cluster: RedisClusterGroup) -> None:
    tag = "{moved}"
    old = cluster.master_of(tag)
    client = _client(cluster)
    acked: list[int] = []
    stop = threading.Event()
    first = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            try:
                client.set(f"{tag}k{n}", n)
            except (redis.RedisError, OSError):  # a redirect redis-py gave up on: the same write again
                stop.wait(0.01)
                continue
            acked.append(n)
            first.set()
            n += 1
            stop.wait(0.002)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert first.wait(30)
        done = cluster.switch_master("--master", f"127.0.0.1:{old}")
        after = len(acked)
        while len(acked) < after + 10 and thread.is_alive():  # writes go on, to the new master
            stop.wait(0.05)
    finally:
        stop.set()
        thread.join(30)
        client.close()
    assert done.returncode == 0, done.stderr[-3000:]
    new = cluster.master_of(tag)
    assert new != old and done.stdout.strip().endswith(f"from 127.0.0.1:{old} to 127.0.0.1:{new}"), done.stdout
    assert _routes(cluster, key_slot(tag.encode())) == {new}  # every node, as the command waited for
    assert _role(old) == "slave" and _role(new) == "master"
    with redis.Redis(port=new) as master:
        values = master.mget([f"{tag}k{n}" for n in acked])
    missing = [n for n, value in zip(acked, values, strict=True) if value is None]
    assert missing == [], f"{len(missing)} of {len(acked)} acknowledged writes lost"


def test_model_names_the_master_of_its_request_stream(cluster: RedisClusterGroup) -> None:
    key = Keys().requests("tiny")
    old = cluster.master_of(key)
    before = cluster.slot_masters()
    done = cluster.switch_master("--model", "tiny")
    assert done.returncode == 0, done.stderr[-3000:]
    new = cluster.master_of(key)
    assert new != old and _routes(cluster, key_slot(key.encode())) == {new}
    # the old master's slots all moved to the new one; the other masters' did not move
    assert cluster.slot_masters() == {start: new if port == old else port for start, port in before.items()}


def test_a_master_without_a_replica_is_refused_and_serves_on(redis_cluster_node: RedisClusterGroup) -> None:
    [port] = redis_cluster_node.live_ports()
    done = redis_cluster_node.switch_master("--master", f"127.0.0.1:{port}")
    assert done.returncode == 1 and "has no replica with a live link" in done.stderr, done.stderr
    with redis.Redis(port=port, socket_timeout=5) as client:
        assert client.set("after", 1)  # not paused


def test_a_failover_that_does_not_happen_fails_and_the_master_stays() -> None:
    """The master frozen (SIGSTOP) with a node timeout long enough that nobody marks it failed: the
    replica never learns the master's offset, so Redis aborts the manual failover."""
    group = RedisClusterGroup(masters=3, replicas=1, node_timeout_ms=120_000)
    try:
        old = group.masters()[0]
        proc = group.nodes[old]
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        try:
            done = group.switch_master("--master", f"127.0.0.1:{old}", timeout=8)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert done.returncode == 1, done.stdout + done.stderr[-3000:]
        assert "timed out waiting for every node to report" in done.stderr, done.stderr[-3000:]
        assert old in group.masters() and _role(old) == "master"
        # serving, its writes not paused for good (the failover request it reads on waking pauses
        # them until Redis's own manual-failover timeout)
        with redis.Redis(port=old, socket_timeout=30) as client:
            assert client.set(_key_on(old, client), 1)
    finally:
        group.stop()


def _key_on(port: int, client: redis.Redis) -> str:
    """A key whose slot the master on `port` serves (as that node reports its slots)."""
    ranges = [(int(s), int(e)) for s, e, master, *_ in client.execute_command("CLUSTER", "SLOTS")
              if int(master[1]) == port]
    return next(key for key in (f"k{i}" for i in range(100_000)) if any(s <= key_slot(key.encode()) <= e
                                                                        for s, e in ranges))


def test_bad_arguments_fail_with_a_message(cluster: RedisClusterGroup) -> None:
    replica = next(p for p in cluster.live_ports() if p not in cluster.masters())
    for target, message in ((("--master", f"127.0.0.1:{replica}"), "is not a master serving slots"),
                            ((), "name the master to move"),
                            (("--master", "127.0.0.1:1,127.0.0.1:2"), "--master takes one address")):
        done = cluster.switch_master(*target)
        assert done.returncode == 1 and message in done.stderr, (target, done.stderr[-2000:])


NODES = """\
07c3 127.0.0.1:30004@40004 slave e7d1 0 1426238317239 4 connected
67ed 127.0.0.1:30002@40002,host-b master - 0 1426238316232 2 connected 5461-10922
292f ::1:30003@40003 master,fail? - 0 1426238318243 3 connected 10923-16383 [93->-e7d1]
e7d1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460 16383
824f :0@0 slave,noaddr 292f 1426238317741 1426238317732 6 disconnected
"""


def test_parse_nodes() -> None:
    nodes = parse_nodes(NODES)
    assert nodes["67ed"].address == ("127.0.0.1", 30002) and nodes["67ed"].slots == ((5461, 10922),)
    assert nodes["292f"].address == ("::1", 30003) and nodes["292f"].down and nodes["292f"].is_master
    assert nodes["292f"].slots == ((10923, 16383),)  # the slot in migration is not counted
    assert nodes["e7d1"].flags == {"master"} and nodes["e7d1"].link_up
    assert nodes["e7d1"].slots == ((0, 5460), (16383, 16383))
    assert nodes["07c3"].master_id == "e7d1" and not nodes["07c3"].is_master
    assert nodes["824f"].down and not nodes["824f"].link_up
