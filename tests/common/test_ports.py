"""free_port: a port nothing listens on, within the process's partition when one is set."""

from __future__ import annotations

import socket

import pytest

from common.ports import PARTITION_ENV, free_port, port_partition, port_slot


@pytest.mark.parametrize("partition", ["0/3", "1/3", "2/3", "1/2"])
def test_ports_stay_in_the_partition_and_are_bindable(partition: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PARTITION_ENV, partition)
    index, count = (int(p) for p in partition.split("/"))
    for _ in range(20):
        port = free_port()
        assert port_slot(port, count) == index
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free indeed


@pytest.mark.parametrize("raw", ["", "x", "3/3", "-1/2", "1/0", "1/2/3"])
def test_a_missing_or_malformed_partition_means_any_port(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PARTITION_ENV, raw)
    assert port_partition() == (0, 1)
    assert 0 < free_port() < 65536


def test_slots_split_even_and_odd_ports_alike() -> None:
    """bind(0) hands out ports of one parity: each slot must still get a fair share of them."""
    for count in (2, 3, 4):
        for parity in (0, 1):
            ports = range(32768 + parity, 61000, 2)
            shares = [sum(port_slot(p, count) == k for p in ports) / len(ports) for k in range(count)]
            assert all(abs(share - 1 / count) < 0.02 for share in shares), (count, parity, shares)
