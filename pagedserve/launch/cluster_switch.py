"""`pagedserve switch-master --redis-cluster`: move one Redis Cluster master's slots to one of its
replicas on purpose, losing no write.

`CLUSTER FAILOVER` sent to a replica (the default form, neither FORCE nor TAKEOVER) is Redis's own
planned switch: the master pauses its clients' writes and tells the replica its replication
offset; the replica waits until it has applied everything up to it, gets elected with a new
config epoch and takes the slots; the old master learns it, becomes its replica, and the writes
that waited are answered MOVED, which every cluster client (pagedserve's included) follows to the
new master. An acknowledged write was applied on the master before the pause, so it is in the
replica's data when it takes over. If the switch does not complete within Redis's own limit
(5 s) the master resumes its writes and stays the master.

Here: find the master (by its address, or as the one serving a key's slot), pick its replica with
a live link and the largest replication offset, send it `CLUSTER FAILOVER`, and wait until every
node not marked failed reports the replica as the master of each of those slots, both in
`CLUSTER SLOTS` (what clients read to route) and in `CLUSTER NODES` (with the old master as its
replica)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from common.log import get_logger

log = get_logger("switch-master")
Address = tuple[str, int]
DOWN_FLAGS = frozenset({"fail", "fail?", "noaddr", "handshake"})


class ClusterSwitchError(RuntimeError):
    """The switch did not happen, or could not be confirmed."""


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One line of `CLUSTER NODES`."""

    node_id: str
    address: Address
    flags: frozenset[str]
    master_id: str  # "-" for a master
    link_up: bool
    slots: tuple[tuple[int, int], ...]  # (first, last) ranges it serves; migrating markers left out

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def down(self) -> bool:
        return bool(self.flags & DOWN_FLAGS)

    def describe(self) -> str:
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_nodes(text: str) -> dict[str, ClusterNode]:
    """`CLUSTER NODES` → node id → node."""
    nodes = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        endpoint = fields[1].split(",", 1)[0].split("@", 1)[0]  # ip:port@busport[,hostname]
        host, _, port = endpoint.rpartition(":")
        slots = []
        for item in fields[8:]:
            if item.startswith("["):  # a slot being imported or migrated: not served yet
                continue
            first, _, last = item.partition("-")
            slots.append((int(first), int(last or first)))
        flags = frozenset(fields[2].split(",")) - {"myself"}
        nodes[fields[0]] = ClusterNode(fields[0], (host, int(port or 0)), flags, fields[3],
                                       fields[7] == "connected" or "myself" in fields[2].split(","), tuple(slots))
    return nodes


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class ClusterSwitch:
    """Some nodes of one cluster (the rest are found through them), and the switch itself."""

    def __init__(self, seeds: tuple[Address, ...], password: str | None, username: str | None, tls: bool) -> None:
        self.seeds = seeds
        # no retries of redis-py's own: a node that does not answer is one timeout, then the next
        # node or the next poll
        self.node_kwargs: dict[str, Any] = {"password": password, "username": username, "ssl": tls,
                                            "socket_timeout": 5.0, "socket_connect_timeout": 5.0,
                                            "retry": Retry(NoBackoff(), 0)}

    def node(self, address: Address) -> redis.Redis:
        return redis.Redis(host=address[0], port=address[1], **self.node_kwargs)

    def nodes_seen_by(self, address: Address) -> dict[str, ClusterNode]:
        with self.node(address) as client:
            return parse_nodes(_text(client.execute_command("CLUSTER", "NODES")))

    def view(self) -> dict[str, ClusterNode]:
        """The cluster's nodes as the first seed that answers sees them."""
        errors = []
        for address in self.seeds:
            try:
                return self.nodes_seen_by(address)
            except (redis.RedisError, OSError) as exc:
                errors.append(f"{address[0]}:{address[1]}: {exc}")
        raise ClusterSwitchError(f"no cluster node answers: {'; '.join(errors)}")

    def master_at(self, address: Address) -> ClusterNode:
        """The master listening at `address`: the node the cluster knows at that address, else the
        node there asked for its own id (so a host name works too)."""
        nodes = self.view()
        found = next((node for node in nodes.values() if node.address == address), None)
        if found is None:
            with self.node(address) as client:
                found = nodes.get(_text(client.execute_command("CLUSTER", "MYID")))
        if found is None or not found.is_master or not found.slots:
            raise ClusterSwitchError(f"{address[0]}:{address[1]} is not a master serving slots "
                                     f"({', '.join(sorted(found.flags)) if found else 'unknown to the cluster'})")
        return found

    def master_of_key(self, key: str) -> ClusterNode:
        """The master serving `key`'s slot."""
        slot = key_slot(key.encode())
        for node in self.view().values():
            if node.is_master and not node.down and any(a <= slot <= b for a, b in node.slots):
                return node
        raise ClusterSwitchError(f"no live master serves slot {slot} (of key {key!r})")

    def pick_replica(self, master: ClusterNode) -> ClusterNode:
        """The replica of `master` whose link to it is up, with the largest replication offset.
        Each other node is asked for its own role: a node's view of the others lags behind by
        gossip (a replica just attached may still show as an empty master)."""
        best: tuple[int, ClusterNode] | None = None
        for candidate in self.view().values():
            if candidate.node_id == master.node_id or candidate.down or candidate.slots:
                continue
            try:
                node = self.nodes_seen_by(candidate.address).get(candidate.node_id)
                if node is None or node.is_master or node.master_id != master.node_id:
                    continue
                with self.node(node.address) as client:
                    info = client.info("replication")
            except (redis.RedisError, OSError):
                continue
            if info.get("master_link_status") != "up":
                continue
            offset = int(info.get("slave_repl_offset", 0))
            if best is None or offset > best[0]:
                best = (offset, node)
        if best is None:
            raise ClusterSwitchError(f"master {master.describe()} has no replica with a live link to it")
        return best[1]

    def run(self, master: ClusterNode, timeout_s: float) -> ClusterNode:
        """Fail `master` over to its best replica and wait until every node reports it; returns
        the new master."""
        replica = self.pick_replica(master)
        log.info("asking the replica to take over (CLUSTER FAILOVER)", master=master.describe(),
                 replica=replica.describe(), slots=slot_ranges(master.slots))
        with self.node(replica.address) as client:
            client.execute_command("CLUSTER", "FAILOVER")
        started = time.monotonic()
        _until(lambda: self._switched(master, replica), started + timeout_s,
               f"every node to report {replica.describe()} as the master of {slot_ranges(master.slots)} "
               f"(the old master {master.describe()} keeps them if the replica did not take over)")
        log.info("switched", old=master.describe(), new=replica.describe(),
                 seconds=round(time.monotonic() - started, 3))
        return replica

    def _switched(self, old: ClusterNode, new: ClusterNode) -> bool:
        """Every node not marked failed sees `new` serving all of `old`'s slots (CLUSTER SLOTS and
        CLUSTER NODES) and `old` as a replica of `new`."""
        try:
            nodes = self.nodes_seen_by(new.address)
            for node in nodes.values():
                if node.down:
                    continue
                seen = self.nodes_seen_by(node.address)
                as_old, as_new = seen.get(old.node_id), seen.get(new.node_id)
                if as_new is None or not as_new.is_master or not _covers(as_new.slots, old.slots):
                    return False
                if as_old is None or as_old.is_master or as_old.master_id != new.node_id:
                    return False
                with self.node(node.address) as client:
                    ranges = client.execute_command("CLUSTER", "SLOTS")
                if not _covers([(int(r[0]), int(r[1])) for r in ranges if _text(r[2][2]) == new.node_id], old.slots):
                    return False
            return True
        except (redis.RedisError, OSError, IndexError):
            return False


def _covers(ranges: Any, wanted: tuple[tuple[int, int], ...]) -> bool:
    served: set[int] = set()
    for first, last in ranges:
        served.update(range(first, last + 1))
    return all(slot in served for first, last in wanted for slot in range(first, last + 1))


def slot_ranges(slots: tuple[tuple[int, int], ...]) -> str:
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in slots)


def _until(condition: Callable[[], bool], deadline: float, what: str) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise ClusterSwitchError(f"timed out waiting for {what}")
        time.sleep(0.05)
