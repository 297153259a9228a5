"""ZeroMQ addresses that users give, parsed strictly before libzmq sees them.

libzmq reads more into an address than it looks like: `tcp://A;B` binds B (A is
a source address), a host may be an interface name (`tcp://eth0:7100`) or `*`,
and a malformed address surfaces as a bare ZMQError. Every address a service
binds or a client connects to goes through `parse_endpoint`, and every bind
without CURVE through `check_bind`, which admits one plain loopback endpoint
only: tcp://127.x.x.x:PORT, tcp://[::1]:PORT, tcp://localhost:PORT or ipc://PATH.
"""
from __future__ import annotations

import errno
import ipaddress
import re
from dataclasses import dataclass
from typing import Any

import click
import zmq

# what an interface or host name may look like (libzmq resolves interface names on bind,
# DNS names on connect); no `;`, `/`, `:` or spaces
_NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9])?")
# sun_path holds 108 bytes with the terminating NUL
MAX_IPC_PATH_BYTES = 107
LOOPBACK_FORMS = "tcp://127.0.0.1:PORT, tcp://[::1]:PORT, tcp://localhost:PORT or ipc://PATH"


class EndpointError(ValueError):
    """An address that is malformed, or that may not be bound without authentication."""


class BindError(EndpointError):
    """An endpoint this host would not bind (in use, not one of its addresses, no permission);
    the message says which and what to do."""

    def __init__(self, endpoint: Endpoint, problem: str) -> None:
        super().__init__(f"{endpoint}: {problem}")
        self.endpoint = endpoint


@dataclass(frozen=True)
class Endpoint:
    """One plain endpoint: `tcp` with a host and a port, or `ipc` with a path (in `host`)."""

    transport: str
    host: str  # tcp: an IP literal (IPv6 without brackets), a name, or "*"; ipc: the path
    port: int | None  # tcp only; 0 binds a free port

    @property
    def ipv6(self) -> bool:
        return self.transport == "tcp" and ":" in self.host

    @property
    def loopback(self) -> bool:
        """Reachable from this host only: ipc, or tcp on a loopback address."""
        if self.transport == "ipc":
            return True
        if self.host == "localhost":
            return True  # a connect address (a bind reads it as 127.0.0.1)
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # "*" or an interface name: whatever it is bound to today

    def __str__(self) -> str:
        if self.transport == "ipc":
            return f"ipc://{self.host}"
        return f"tcp://[{self.host}]:{self.port}" if self.ipv6 else f"tcp://{self.host}:{self.port}"


def parse_endpoint(address: str, *, bind: bool) -> Endpoint:
    """`address` as one plain tcp:// or ipc:// endpoint, or EndpointError saying what is wrong.

    `bind` admits port 0 (a free port) and, as libzmq does, the host `*` and interface names;
    a connect needs a port from 1 to 65535 and a host that is an IP literal or a DNS name."""
    example = "tcp://127.0.0.1:7100" if bind else "tcp://HOST:7100"
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc"):
        raise EndpointError(f"{address!r} is not a tcp:// or ipc:// address; write it as "
                            f"{example} or ipc:///path/to/socket")
    if scheme == "ipc":
        if not rest or not rest.isprintable() or ";" in rest:
            raise EndpointError(f"{address!r}: an ipc address is ipc:// and a file path of "
                                "printable characters, without ';'")
        if len(rest.encode()) > MAX_IPC_PATH_BYTES:
            raise EndpointError(f"{address!r}: the ipc path is longer than "
                                f"{MAX_IPC_PATH_BYTES} bytes; use a shorter path")
        return Endpoint("ipc", rest, None)
    if ";" in rest:
        raise EndpointError(f"{address!r} has a ';': libzmq would take the part before it as a "
                            f"source address and use the part after it; give one endpoint, "
                            f"e.g. {example}")
    m = re.fullmatch(r"(\[[^\]]*\]|[^:\[\]]*):([0-9]{1,5})", rest)
    if m is None:
        raise EndpointError(f"{address!r} is not HOST:PORT after tcp://; write it as {example} "
                            "(an IPv6 host in brackets, e.g. tcp://[::1]:7100)")
    host, port = m.group(1), int(m.group(2))
    low = 0 if bind else 1
    if not low <= port <= 65535:
        raise EndpointError(f"{address!r}: the port must be between {low} and 65535")
    if host.startswith("["):
        try:
            ip6 = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise EndpointError(f"{address!r}: {host} is not an IPv6 address") from None
        if ip6.scope_id is not None:
            raise EndpointError(f"{address!r}: IPv6 scope ids (%...) are not supported")
        return Endpoint("tcp", str(ip6), port)
    if bind and host == "*":
        return Endpoint("tcp", host, port)
    if re.fullmatch(r"[0-9.]+", host):
        try:
            return Endpoint("tcp", str(ipaddress.IPv4Address(host)), port)
        except ValueError:
            raise EndpointError(f"{address!r}: {host} is not an IPv4 address (four numbers "
                                "0-255, without leading zeros)") from None
    if _NAME_RE.fullmatch(host) is None:
        raise EndpointError(f"{address!r}: {host!r} is not a host name or IP address")
    if bind and host == "localhost":  # what it means here, never an interface of that name
        host = "127.0.0.1"
    return Endpoint("tcp", host, port)


def check_bind(address: str, *, authenticated: bool) -> Endpoint:
    """`address` parsed for a bind; without CURVE it must be one plain loopback endpoint."""
    endpoint = parse_endpoint(address, bind=True)
    if not authenticated and not endpoint.loopback:
        raise EndpointError(f"refusing to bind {address} without authentication: "
                            f"{_reach(endpoint)}, and anyone who can reach it could use it; "
                            f"bind loopback ({LOOPBACK_FORMS}) or pass --auth DIR (see "
                            "`statesvc keys init`)")
    return endpoint


def _reach(endpoint: Endpoint) -> str:
    """Why a bind to `endpoint` may be reachable from elsewhere."""
    try:
        ip = ipaddress.ip_address(endpoint.host)
    except ValueError:
        return ("* binds every interface" if endpoint.host == "*" else
                f"{endpoint.host} is an interface name, which binds whatever address it has")
    return f"{ip} binds every interface" if ip.is_unspecified else f"{ip} is not loopback"


def bind_problem(err: int | None, strerror: str | None, *, ipc: bool = False) -> str:
    """Why a bind failed, in words that say what to do (`err`: its errno)."""
    other = "choose another path" if ipc else "choose another port"
    if err == errno.EADDRINUSE:
        return f"address already in use; stop what holds it or {other}"
    if err == errno.EADDRNOTAVAIL:
        return "not an address of this host; give one of its own addresses"
    if err == errno.EACCES:
        return (f"permission denied; {other} you may use" if ipc else
                "permission denied; ports below 1024 need privileges, choose a port from 1024")
    if ipc and err == errno.ENOENT:
        return "the ipc path's directory does not exist; create it or choose another path"
    return f"cannot bind: {strerror or 'error ' + str(err)}"


def bind(sock: zmq.Socket[Any], endpoint: Endpoint) -> str:
    """Bind `sock` to `endpoint` (IPv6 switched on when it needs it); the bound address, or
    BindError saying why the OS refused it."""
    if endpoint.ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(str(endpoint))
    except zmq.ZMQError as exc:
        raise BindError(endpoint, bind_problem(exc.errno, exc.strerror,
                                               ipc=endpoint.transport == "ipc")) from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket[Any], address: str) -> None:
    """Connect `sock` to `address`, parsed strictly (EndpointError when it is malformed)."""
    endpoint = parse_endpoint(address, bind=False)
    if endpoint.ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(str(endpoint))


def split_addresses(address: str) -> list[str]:
    """`a,b,...`: the addresses of the statesvc instances of one log, in order of preference.
    Each is one endpoint (parse_endpoint); an empty one or a repeat is refused."""
    parts = [a.strip() for a in address.split(",")]
    if not all(parts):
        raise EndpointError(f"{address!r} has an empty address; separate the addresses of "
                            "several instances with single commas, e.g. "
                            "tcp://10.0.0.1:7100,tcp://10.0.0.2:7100")
    if len(set(parts)) != len(parts):
        raise EndpointError(f"{address!r} names one address twice; name each instance once")
    for part in parts:
        parse_endpoint(part, bind=False)
    return parts


def click_addresses(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """click_address for options that may name several statesvc instances (`a,b`)."""
    if value is not None:
        try:
            split_addresses(value)
        except EndpointError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def click_address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback for options that name an address to connect to: a malformed one is a
    usage error that says what is wrong."""
    if value is not None:
        try:
            parse_endpoint(value, bind=False)
        except EndpointError as exc:
            raise click.BadParameter(str(exc)) from None
    return value
