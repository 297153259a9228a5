"""Ports the fleet launcher hands out: below the kernel's ephemeral range, one slab per test
worker, never the same one twice in a process (a statesvc restarted on its address must find
it free: an outgoing connection's ephemeral port once took it, CI stop 34)."""
from __future__ import annotations

import pytest

from statesvc.tools import processes


def test_ports_come_from_the_workers_own_slab_below_the_ephemeral_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slabs = {}
    for worker in ["", "gw0", "gw1", "gw5"]:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slabs[worker] = processes._slab()
        ports = [processes.free_port() for _ in range(50)]
        assert len(set(ports)) == 50
        assert all(p in slabs[worker] for p in ports), (worker, ports)
        assert all(p < processes._ephemeral_start() for p in ports)
    bounds = sorted((s.start, s.stop) for s in slabs.values())
    assert all(a[1] <= b[0] for a, b in zip(bounds, bounds[1:])), bounds


def test_with_no_room_below_the_ephemeral_range_the_kernel_picks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "_ephemeral_start", lambda: 1024)
    assert processes._slab() == range(0)
    port = processes.free_port()
    assert 0 < port < 65536


def test_a_share_of_the_slab_keeps_processes_side_by_side_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick bench suite runs two benchmarks at once under one worker: each takes its own
    share of the worker's slab (benchmarks/suite.py sets LORAPLANE_PORT_SHARE)."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    whole = processes._slab()
    shares = []
    for i in range(3):
        monkeypatch.setenv(processes.PORT_SHARE_ENV, f"{i}/16")
        shares.append(processes._slab())
        ports = [processes.free_port() for _ in range(20)]
        assert all(p in shares[i] for p in ports), (i, ports)
    assert all(len(s) == len(whole) // 16 and s.start >= whole.start and s.stop <= whole.stop for s in shares)
    assert shares[0].stop <= shares[1].start and shares[1].stop <= shares[2].start
    for bad in ("16/16", "x/2", "1/0", ""):  # not a share: the whole slab
        monkeypatch.setenv(processes.PORT_SHARE_ENV, bad)
        assert processes._slab() == whole
