"""`free_port`: a TCP port nothing listens on, for the servers pagedserve starts on loopback
(the embedded Redis, a tensor-parallel group's rendezvous) and for tests. Torch-free.

Concurrent test workers on one machine (pytest-xdist) each pick ports for the processes they
start, and a port picked by one is free until its server binds it, so another worker could pick
it too. `PAGEDSERVE_PORT_PARTITION="k/N"` (the test suite sets it in worker k of N; children
inherit it) keeps a process to the ports whose hash is k mod N: two workers never pick the same
one. (A hash, not the port itself: Linux hands `bind(0)` ports of one parity.) Unset, any free
port the kernel offers."""

from __future__ import annotations

import os
import socket

PARTITION_ENV = "PAGEDSERVE_PORT_PARTITION"


def port_partition() -> tuple[int, int]:
    """(k, N) from the environment, (0, 1) when unset or malformed."""
    raw = os.environ.get(PARTITION_ENV, "")
    try:
        index, count = (int(part) for part in raw.split("/"))
    except ValueError:
        return 0, 1
    return (index, count) if count > 0 and 0 <= index < count else (0, 1)


def port_slot(port: int, count: int) -> int:
    """Which of `count` partitions `port` belongs to (Fibonacci hashing of the port number)."""
    return ((port * 0x9E3779B1) & 0xFFFFFFFF) * count >> 32


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (in this process's partition)."""
    index, count = port_partition()
    for _ in range(64 * count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port_slot(port, count) == index:
            return port
    raise OSError(f"no free port in partition {index}/{count} after {64 * count} tries")
