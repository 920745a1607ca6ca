"""`pagedserve switch-master` on a real Sentinel group (a master, two replicas, three sentinels on
loopback): a client writing through Sentinel all along loses none of its acknowledged writes,
the old master ends a replica of the new one; without a replica the switch is refused and the
master's writes are not left paused. And `up`'s reading of its children's flags."""

from __future__ import annotations

import threading
import time

import redis
from redis.sentinel import Sentinel

from pagedserve.launch.up import _flag
from tests.fixtures.redis import MASTER_NAME, SentinelGroup


def test_switch_loses_no_acknowledged_write(sentinel_group: SentinelGroup) -> None:
    old = sentinel_group.master_port()
    sentinel = Sentinel(list(sentinel_group.sentinel_addresses), socket_timeout=5)
    client = sentinel.master_for(MASTER_NAME, socket_timeout=5)
    acked: list[int] = []
    stop = threading.Event()
    first = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            try:
                client.set(f"k{n}", n)
            except redis.RedisError:  # READONLY from the demoted master, a dropped connection: again
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
        done = sentinel_group.switch_master()
        after = len(acked)
        while len(acked) < after + 10 and thread.is_alive():  # writes go on, to the new master
            stop.wait(0.05)
    finally:
        stop.set()
        thread.join(30)
    assert done.returncode == 0, done.stderr[-3000:]
    new = sentinel_group.master_port()
    assert new != old and f"from 127.0.0.1:{old} to 127.0.0.1:{new}" in done.stdout, done.stdout
    with redis.Redis(port=new) as master:
        values = master.mget([f"k{n}" for n in acked])
    missing = [n for n, value in zip(acked, values, strict=True) if value is None]
    assert missing == [], f"{len(missing)} of {len(acked)} acknowledged writes lost"
    with redis.Redis(port=old) as demoted:
        assert demoted.info("replication")["role"] == "slave"
    client.connection_pool.disconnect()


def test_no_replica_no_switch_and_writes_go_on(sentinel_group: SentinelGroup) -> None:
    port = sentinel_group.master_port()
    for node, proc in sentinel_group.nodes.items():  # the replicas go away
        if node != port and proc is not None:
            proc.kill()
            proc.wait()
            sentinel_group.nodes[node] = None
    with redis.Redis(port=port, socket_timeout=5) as master:
        while int(master.info("replication")["connected_slaves"]):
            time.sleep(0.05)
        done = sentinel_group.switch_master()
        assert done.returncode == 1 and "not a master with a replica" in done.stderr, done.stderr
        assert sentinel_group.master_port() == port
        assert master.set("after", 1)  # not paused


def test_up_reads_the_last_value_of_a_child_flag() -> None:
    assert _flag(["--drain-timeout", "5", "--x", "1"], "--drain-timeout", 30.0) == 5.0
    assert _flag(["--drain-timeout=2", "--drain-timeout", "7"], "--drain-timeout", 30.0) == 7.0
    assert _flag(["--other", "5"], "--drain-timeout", 30.0) == 30.0
    assert _flag(["--drain-timeout", "soon"], "--drain-timeout", 30.0) == 30.0
