"""`pagedserve switch-master`: move a Sentinel-managed Redis master to one of its replicas on
purpose, losing no write (with `--redis-cluster`, a cluster master: `cluster_switch`).

A bare `SENTINEL FAILOVER` promotes a replica while the old master keeps running: the sentinels
demote it only after they have seen it still claim the role for a while, and every client still
connected to it writes there meanwhile; those writes are dropped when it resyncs as a replica (the
WAIT after each write times out without replicas and does not stop them). So the switch here is:

1. `CLIENT PAUSE <ms> WRITE` on the master: every write (of engines, gateways) waits, reads go on;
2. wait until each replica's replication offset reaches the master's (they hold every write);
3. `SENTINEL FAILOVER <name>` on a sentinel, and wait until every sentinel reports the new master
   in `SENTINEL MASTERS`, which is what clients ask when they reconnect (it changes when the
   failover ends, about a second after `GET-MASTER-ADDR-BY-NAME` names the promoted replica;
   unpaused before that, reconnecting clients found the old master again and got READONLY
   until then);
4. `REPLICAOF <new>` on the old master at once (what the sentinels would do only later);
5. `CLIENT UNPAUSE`: the writes that waited now get READONLY from the demoted node, and every
   pagedserve client reconnects to the master the sentinels report and sends them again.

Writes wait for about as long as steps 2-4 take. If the failover does not
happen, the master is unpaused and stays the master."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from common.log import get_logger
from common.protocol import Keys
from common.redis_spec import DEFAULT_MASTER, parse_cluster_nodes, parse_sentinels
from pagedserve.launch.cluster_switch import ClusterNode, ClusterSwitch, ClusterSwitchError, slot_ranges

log = get_logger("switch-master")


class SwitchError(RuntimeError):
    """The switch did not happen (the old master, unpaused, still serves)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--redis-sentinel", default=env("PAGEDSERVE_REDIS_SENTINEL"), metavar="HOST:PORT[,...]",
                        help="the sentinels (default $PAGEDSERVE_REDIS_SENTINEL)")
    parser.add_argument("--redis-sentinel-master", default=env("PAGEDSERVE_REDIS_SENTINEL_MASTER", DEFAULT_MASTER),
                        metavar="NAME", help="the master's name in the sentinels' configuration (default %(default)s)")
    parser.add_argument("--redis-cluster", default=env("PAGEDSERVE_REDIS_CLUSTER"), metavar="HOST:PORT[,...]",
                        help="instead of sentinels, some nodes of a Redis Cluster (default $PAGEDSERVE_REDIS_CLUSTER): "
                             "one master's slots move to its replica by CLUSTER FAILOVER")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="with --redis-cluster: the master to move")
    target.add_argument("--model", default=None, metavar="NAME",
                        help="with --redis-cluster: move the master holding this served model's request stream "
                             "(its slot also holds the model's engines' liveness keys and dead letters)")
    parser.add_argument("--redis-password", default=None, help="the master's or the cluster nodes' password "
                                                               "(default $PAGEDSERVE_REDIS_PASSWORD)")
    parser.add_argument("--redis-username", default=None, help="ACL user of the master or the cluster's nodes")
    parser.add_argument("--redis-sentinel-password", default=None,
                        help="the sentinels' password (default $PAGEDSERVE_REDIS_SENTINEL_PASSWORD)")
    parser.add_argument("--redis-tls", action="store_true", help="TLS to the sentinels and the nodes")
    parser.add_argument("--pause", type=float, default=10.0, metavar="SECONDS",
                        help="longest the master's writes are paused (CLIENT PAUSE's timeout; default %(default)s): "
                             "past it a stuck switch lets writes go on (Sentinel only: a cluster master pauses "
                             "itself during CLUSTER FAILOVER)")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                        help="longest wait for the sentinels, or every cluster node, to report the new master "
                             "(default %(default)s)")


class Switch:
    """The nodes of one Sentinel setup, and the switch itself."""

    def __init__(self, sentinels: tuple[tuple[str, int], ...], master: str, password: str | None,
                 sentinel_password: str | None, tls: bool, username: str | None = None) -> None:
        self.sentinels = sentinels
        self.master = master
        self.node_kwargs: dict[str, Any] = {"password": password, "username": username, "ssl": tls,
                                            "socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        self.sentinel_kwargs: dict[str, Any] = {**self.node_kwargs, "password": sentinel_password, "username": None}

    def _sentinel(self, host: str, port: int) -> redis.Redis:
        return redis.Redis(host=host, port=port, **self.sentinel_kwargs)

    def node(self, address: tuple[str, int]) -> redis.Redis:
        return redis.Redis(host=address[0], port=address[1], **self.node_kwargs)

    def reported_master(self) -> tuple[str, int]:
        """The master the reachable sentinels agree on, as clients ask for it (`SENTINEL
        MASTERS`, what redis-py reads: during a failover it still names the old master, while
        `GET-MASTER-ADDR-BY-NAME` already names the promoted replica); SwitchError when they
        disagree, none answers or one reports its master down."""
        seen: set[tuple[str, int] | None] = set()
        for host, port in self.sentinels:
            try:
                with self._sentinel(host, port) as client:
                    state = client.sentinel_master(self.master)
            except (redis.RedisError, OSError):
                continue
            usable = state.get("is_master") and not state.get("is_sdown") and not state.get("is_odown")
            seen.add((str(state["ip"]), int(state["port"])) if usable else None)
        if len(seen) != 1 or None in seen:
            raise SwitchError(f"the sentinels report {sorted(seen, key=str) or 'no master'} for {self.master!r}")
        found = seen.pop()
        assert found is not None
        return found

    def run(self, pause_s: float, timeout_s: float) -> tuple[tuple[str, int], tuple[str, int]]:
        """Switch; returns (old master, new master)."""
        old = self.reported_master()
        with self.node(old) as master:
            info = master.info("replication")
            if info.get("role") != "master" or int(info.get("connected_slaves", 0)) < 1:
                raise SwitchError(f"{old[0]}:{old[1]} is not a master with a replica: {info.get('role')}, "
                                  f"{info.get('connected_slaves', 0)} replicas")
            master.execute_command("CLIENT", "PAUSE", int(pause_s * 1000), "WRITE")
            paused = time.monotonic()
            log.info("writes paused", master=f"{old[0]}:{old[1]}", longest_s=pause_s)
            try:
                deadline = paused + pause_s / 2
                _until(lambda: _replicas_caught_up(master), deadline, "the replicas to reach the master's offset")
                log.info("replicas caught up; asking the sentinels to fail over", master=self.master)
                self._failover()
                new = self._wait_new_master(old, time.monotonic() + timeout_s)
                master.execute_command("REPLICAOF", new[0], str(new[1]))
                log.info("old master demoted", old=f"{old[0]}:{old[1]}", new=f"{new[0]}:{new[1]}")
            finally:
                master.execute_command("CLIENT", "UNPAUSE")
                log.info("writes unpaused", paused_s=round(time.monotonic() - paused, 3))
        return old, new

    def _failover(self) -> None:
        errors = []
        for host, port in self.sentinels:
            try:
                with self._sentinel(host, port) as client:
                    client.execute_command("SENTINEL", "FAILOVER", self.master)
                return
            except (redis.RedisError, OSError) as exc:
                errors.append(f"{host}:{port}: {exc}")
        raise SwitchError(f"no sentinel started the failover: {'; '.join(errors)}")

    def _wait_new_master(self, old: tuple[str, int], deadline: float) -> tuple[str, int]:
        found: list[tuple[str, int]] = []

        def moved() -> bool:
            try:
                now = self.reported_master()
                if now == old:
                    return False
                with self.node(now) as client:
                    if client.info("replication").get("role") != "master":
                        return False
            except (SwitchError, redis.RedisError, OSError):
                return False
            found.append(now)
            return True

        _until(moved, deadline, "the sentinels to report a new master")
        return found[-1]


def _replicas_caught_up(master: redis.Redis) -> bool:
    info = master.info("replication")
    offset = int(info.get("master_repl_offset", 0))
    replicas = [info[f"slave{i}"] for i in range(int(info.get("connected_slaves", 0))) if f"slave{i}" in info]
    return bool(replicas) and all(int(r.get("offset", -1)) >= offset for r in replicas)


def _until(condition: Callable[[], bool], deadline: float, what: str) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise SwitchError(f"timed out waiting for {what}")
        time.sleep(0.05)


def run(args: argparse.Namespace) -> int:
    """Switch the master; 0 and one line naming both nodes, 1 with the reason when it did not happen."""
    if args.redis_cluster:
        return run_cluster(args)
    env = os.environ.get
    try:
        if not args.redis_sentinel:
            raise ValueError("--redis-sentinel or --redis-cluster (or $PAGEDSERVE_REDIS_SENTINEL, "
                             "$PAGEDSERVE_REDIS_CLUSTER) is required")
        if args.master or args.model:
            raise ValueError("--master and --model pick a cluster master: they need --redis-cluster")
        switch = Switch(parse_sentinels(args.redis_sentinel), args.redis_sentinel_master,
                        args.redis_password or env("PAGEDSERVE_REDIS_PASSWORD") or None,
                        args.redis_sentinel_password or env("PAGEDSERVE_REDIS_SENTINEL_PASSWORD") or None,
                        args.redis_tls, args.redis_username)
        old, new = switch.run(args.pause, args.timeout)
    except (ValueError, SwitchError, redis.RedisError, OSError) as exc:
        print(f"pagedserve switch-master: error: {exc}", file=sys.stderr)
        return 1
    print(f"master {args.redis_sentinel_master!r} moved from {old[0]}:{old[1]} to {new[0]}:{new[1]}", flush=True)
    return 0


def run_cluster(args: argparse.Namespace) -> int:
    """The cluster form: the master given by --master or --model moves to its best replica."""
    try:
        if args.redis_sentinel:
            raise ValueError("--redis-sentinel and --redis-cluster exclude each other")
        if not (args.master or args.model):
            raise ValueError("with --redis-cluster, name the master to move: --master HOST:PORT or --model NAME")
        switch = ClusterSwitch(parse_cluster_nodes(args.redis_cluster),
                               args.redis_password or os.environ.get("PAGEDSERVE_REDIS_PASSWORD") or None,
                               args.redis_username, args.redis_tls)
        master: ClusterNode
        if args.master:
            addresses = parse_cluster_nodes(args.master)
            if len(addresses) != 1:
                raise ValueError(f"--master takes one address, not {args.master!r}")
            master = switch.master_at(addresses[0])
        else:
            master = switch.master_of_key(Keys().requests(args.model))
        new = switch.run(master, args.timeout)
    except (ValueError, ClusterSwitchError, redis.RedisError, OSError) as exc:
        print(f"pagedserve switch-master: error: {exc}", file=sys.stderr)
        return 1
    print(f"master of slots {slot_ranges(master.slots)} moved from {master.describe()} to {new.describe()}", flush=True)
    return 0
