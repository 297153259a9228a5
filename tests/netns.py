"""Hosts for tests: network namespaces on one bridge (tests, never a deployment).

`Hosts` makes a hub namespace holding a bridge, and for each host a namespace of its own
joined to the bridge by a veth pair (`eth0` inside, an address of SUBNET). Processes start
in a host through `wrapper(host)` (`ip netns exec NS`); the test's own thread joins a host
with `entered(host)` (setns(2) on the calling thread only: the rest of the process stays
where it was). `cut(host)` takes the host's bridge port down (its packets are dropped, as
with a pulled cable: no RST, no FIN), `restore(host)` brings it back. Everything is made
under a random tag and deleted by `close()`, also at interpreter exit.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import subprocess
import threading
import uuid
from contextlib import contextmanager
from typing import Iterator

SUBNET = "10.77.0"  # the hosts' /24, inside the namespaces only: no route of this machine
CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")


class Hosts:
    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.hub = f"lp{self.tag}-hub"
        self.hosts: dict[str, tuple[str, str]] = {}  # host -> (namespace, its address)
        _ip("netns", "add", self.hub)
        atexit.register(self.close)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")

    @staticmethod
    def missing() -> str | None:
        """Why namespaces cannot be made here, or None (tried: one made and deleted)."""
        if shutil.which("ip") is None:
            return "network-namespace test: `ip` (iproute2) not found; install iproute2"
        if os.geteuid() != 0:
            return ("network-namespace test: needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN, to "
                    "make namespaces and veth pairs and setns(2) into them); `make test` as "
                    "root runs it")
        name = f"lp{uuid.uuid4().hex[:6]}-probe"
        res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if res.returncode != 0:
            return (f"network-namespace test: `ip netns add` refused ({res.stderr.strip()}); "
                    "a container needs CAP_SYS_ADMIN and a writable /run/netns")
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        return None

    def add(self, host: str) -> str:
        """A namespace for `host` on the bridge; returns its address."""
        ns, port = f"lp{self.tag}-{host}", f"p{len(self.hosts)}"
        address = f"{SUBNET}.{len(self.hosts) + 2}"
        _ip("netns", "add", ns)
        self.hosts[host] = (ns, address)
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns",
            self.hub)
        _ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return address

    def _port(self, host: str) -> str:
        return f"p{list(self.hosts).index(host)}"

    def cut(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self._port(host), "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self._port(host), "up")

    def wrapper(self, host: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.hosts[host][0])

    @contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """The calling thread in `host`'s namespace: sockets it (and threads it starts, a
        ZeroMQ context's I/O threads among them) opens meanwhile are that host's."""
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        there = os.open(f"/run/netns/{self.hosts[host][0]}", os.O_RDONLY)
        try:
            if libc.setns(there, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {host}'s namespace")
            try:
                yield
            finally:
                if libc.setns(own, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(there)
            os.close(own)

    def close(self) -> None:
        for ns, _ in self.hosts.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.hosts.clear()
        subprocess.run(["ip", "netns", "del", self.hub], capture_output=True)
