"""Where Redis is, as both sides' CLIs give it: a URL, Redis Sentinel addresses plus the name of
the master they watch (`--redis-sentinel HOST:PORT[,HOST:PORT...]`, `--redis-sentinel-master`),
or some nodes of a Redis Cluster (`--redis-cluster HOST:PORT[,HOST:PORT...]`), with passwords
and TLS; and how many replicas must acknowledge a write that has to survive a failover (`WAIT`).
Torch-free; `common.redis_conn` turns a spec into clients."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_MASTER = "mymaster"
DEFAULT_CLUSTER_PORT = 6379


def parse_sentinels(text: str) -> tuple[tuple[str, int], ...]:
    """``HOST:PORT[,HOST:PORT...]`` → ``((host, port), ...)``. The port defaults to 26379; an IPv6
    host is written ``[::1]:26379``. Raises ValueError on an empty list, a bad port or a repeat."""
    return parse_addresses(text, DEFAULT_SENTINEL_PORT, "sentinel")


def parse_cluster_nodes(text: str) -> tuple[tuple[str, int], ...]:
    """`parse_sentinels` for the nodes of a Redis Cluster (the port defaults to 6379)."""
    return parse_addresses(text, DEFAULT_CLUSTER_PORT, "cluster node")


def parse_addresses(text: str, default_port: int, what: str) -> tuple[tuple[str, int], ...]:
    """``HOST:PORT[,HOST:PORT...]`` → ``((host, port), ...)``, `what` naming them in errors."""
    found: list[tuple[str, int]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.startswith("["):
            host, bracket, rest = item[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise ValueError(f"bad {what} address {item!r} (IPv6 is [HOST]:PORT)")
            port_text = rest[1:]
        elif item.count(":") > 1:
            raise ValueError(f"bad {what} address {item!r} (write an IPv6 host as [HOST]:PORT)")
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise ValueError(f"bad {what} address {item!r}: no host")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ValueError(f"bad {what} address {item!r}: port {port_text!r} is not a number") from None
        if not 0 < port < 65536:
            raise ValueError(f"bad {what} address {item!r}: port out of range")
        if (host, port) in found:
            raise ValueError(f"{what} {host}:{port} given twice")
        found.append((host, port))
    if not found:
        raise ValueError(f"no {what} address given")
    return tuple(found)


@dataclass(frozen=True, slots=True)
class RedisSpec:
    """A URL (which carries its own password and TLS: ``rediss://``), or, when `sentinels` is
    non-empty, the master called `master` as those sentinels report it (then `password`,
    `username`, `tls` and `db` apply to the master, `sentinel_password` to the sentinels); or,
    when `cluster` is non-empty, the Redis Cluster those nodes belong to (`password`,
    `username` and `tls` apply to its nodes; a cluster has only db 0).

    `wait_replicas` replicas must acknowledge a write that has to survive a failover (None:
    1 with sentinels or a cluster, 0 with a URL); `wait_timeout_ms` bounds each such wait."""

    url: str = DEFAULT_URL
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = DEFAULT_MASTER
    password: str | None = None
    username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False
    db: int = 0
    wait_replicas: int | None = None
    wait_timeout_ms: int = 500
    cluster: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.sentinels and self.cluster:
            raise ValueError("--redis-sentinel and --redis-cluster exclude each other")
        if self.sentinels and not self.master:
            raise ValueError("a sentinel setup needs the master's name (--redis-sentinel-master)")
        if self.wait_replicas is not None and self.wait_replicas < 0:
            raise ValueError("wait_replicas must be >= 0")
        if self.wait_timeout_ms <= 0:
            raise ValueError("wait_timeout_ms must be positive (WAIT with 0 would block for ever)")

    @property
    def uses_sentinel(self) -> bool:
        return bool(self.sentinels)

    @property
    def uses_cluster(self) -> bool:
        return bool(self.cluster)

    @property
    def mode(self) -> str:
        """"url", "sentinel" or "cluster" (for /health and the retry rules that differ)."""
        return "cluster" if self.cluster else "sentinel" if self.sentinels else "url"

    @property
    def replicas_to_wait(self) -> int:
        if self.wait_replicas is not None:
            return self.wait_replicas
        return 1 if self.sentinels or self.cluster else 0

    def describe(self) -> str:
        """For logs and /health: no password."""
        if self.cluster:
            return "cluster via " + ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.cluster)
        if not self.sentinels:
            return redact_url(self.url)
        addresses = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.sentinels)
        return f"sentinel {self.master} via {addresses}"


def redact_url(url: str) -> str:
    """`url` with its password (and user) replaced by ``***``: safe for logs and error bodies."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable redis url>"
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, parts.fragment))


def add_redis_arguments(parser: argparse.ArgumentParser, default_url: str = DEFAULT_URL) -> None:
    """The Redis options both `pagedserve gateway` and `pagedserve engine` take (passwords also
    from the environment, so they stay out of process listings)."""
    env = os.environ.get
    parser.add_argument("--redis-url", default=env("PAGEDSERVE_REDIS_URL", default_url),
                        help="Redis URL (default $PAGEDSERVE_REDIS_URL or %(default)s); ignored with --redis-sentinel "
                             "or --redis-cluster")
    parser.add_argument("--redis-sentinel", default=env("PAGEDSERVE_REDIS_SENTINEL"), metavar="HOST:PORT[,...]",
                        help="Redis Sentinel addresses (also $PAGEDSERVE_REDIS_SENTINEL): connect to the master they "
                             "report, and follow it across failovers")
    parser.add_argument("--redis-sentinel-master", default=env("PAGEDSERVE_REDIS_SENTINEL_MASTER", DEFAULT_MASTER),
                        metavar="NAME", help="the master's name in the sentinels' configuration (default %(default)s)")
    parser.add_argument("--redis-cluster", default=env("PAGEDSERVE_REDIS_CLUSTER"), metavar="HOST:PORT[,...]",
                        help="some nodes of a Redis Cluster (also $PAGEDSERVE_REDIS_CLUSTER): keys spread over its "
                             "masters by hash slot; redirects and failovers are followed")
    parser.add_argument("--redis-password", default=None,
                        help="password of the Sentinel-managed master or the cluster's nodes "
                             "(default $PAGEDSERVE_REDIS_PASSWORD)")
    parser.add_argument("--redis-username", default=None,
                        help="ACL user of the Sentinel-managed master or the cluster's nodes")
    parser.add_argument("--redis-sentinel-password", default=None,
                        help="password of the sentinels (default $PAGEDSERVE_REDIS_SENTINEL_PASSWORD)")
    parser.add_argument("--redis-tls", action="store_true", help="TLS to the sentinels and the master, or to the "
                                                                   "cluster's nodes")
    parser.add_argument("--redis-wait-replicas", type=int, default=None, metavar="N",
                        help="replicas that must acknowledge (WAIT) each request and each step's output before it "
                             "counts as sent (default 1 with --redis-sentinel or --redis-cluster, else 0)")
    parser.add_argument("--redis-wait-timeout", type=int, default=500, metavar="MS",
                        help="milliseconds one WAIT may take (default %(default)s); a master without replicas is "
                             "then used unacknowledged (see /health) and asked again every few seconds")


def spec_from_args(args: argparse.Namespace) -> RedisSpec:
    """The spec of `add_redis_arguments`' options. Raises ValueError on a bad sentinel or node
    list, or both given."""
    env = os.environ.get
    sentinels = parse_sentinels(args.redis_sentinel) if args.redis_sentinel else ()
    cluster = parse_cluster_nodes(args.redis_cluster) if getattr(args, "redis_cluster", None) else ()
    return RedisSpec(cluster=cluster,
        url=args.redis_url, sentinels=sentinels, master=args.redis_sentinel_master,
        password=args.redis_password or env("PAGEDSERVE_REDIS_PASSWORD") or None, username=args.redis_username,
        sentinel_password=args.redis_sentinel_password or env("PAGEDSERVE_REDIS_SENTINEL_PASSWORD") or None,
        tls=args.redis_tls, wait_replicas=args.redis_wait_replicas, wait_timeout_ms=args.redis_wait_timeout)
