"""What a web page in the operator's browser must not do through the gateway: the checks in
front of every endpoint (docs/security.md, "Gateway HTTP").

Without --auth the load and unload endpoints are open to anything that reaches the gateway,
and a browser reaches loopback. A page on any site can POST there (a form, or fetch with a
`text/plain` body, needs no CORS preflight), and a name that the page's site resolves first to
itself and then to 127.0.0.1 (DNS rebinding) makes the gateway's answers the page's to read.
So, before any endpoint:

- `Host` must name the gateway (`--allowed-hosts`, by default the bound address and its
  names): a rebound name's requests carry that name, and are refused (400 `invalid_host`);
- a POST whose `Origin` is another origin than the one it was sent to (or `null`, a sandboxed
  or file page) is refused (403 `cross_origin`); clients that are not browsers send none;
- an admin POST (load, unload) must say `Content-Type: application/json` (415), which no
  form can send, and which makes a browser's fetch ask first (a preflight this gateway never
  grants);
- a path with a trailing slash is redirected (307) to the path without it by a relative
  `Location`, never a URL built from the request's `Host`.
"""
from __future__ import annotations

import ipaddress
import json
import socket
from typing import Callable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import ApiError

ANY_HOST = "*"
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def host_name(authority: str) -> str:
    """The host of a `Host` header or an origin's authority, without its port, lowercased:
    `[::1]:8000` -> `::1`, `Example.COM.:80` -> `example.com`."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1:].split("]", 1)[0]
    if authority.count(":") == 1:
        authority = authority.rsplit(":", 1)[0]
    return authority.rstrip(".")


def default_hosts(host: str) -> frozenset[str]:
    """The names a gateway bound to `host` answers to by default: the address itself, and for
    loopback `localhost` and the loopback addresses; for a wildcard (0.0.0.0, ::) this
    machine's host names and `localhost`, and any IP address (`ip` below: a rebinding attack
    needs a name, never an address)."""
    name = host_name(host)
    names = {name}
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        addr = None
    if name == "localhost" or (addr is not None and addr.is_loopback):
        names |= {"localhost", "127.0.0.1", "::1"}
    elif addr is not None and addr.is_unspecified:
        names |= {"localhost", "ip", socket.gethostname().lower(), socket.getfqdn().lower()}
    return frozenset(names)


def parse_allowed_hosts(value: str) -> frozenset[str]:
    """`--allowed-hosts a,b`: names, addresses, `ip` (any IP address) or `*` (any host)."""
    names = frozenset(host_name(v) for v in value.split(",") if v.strip())
    if not names:
        raise ValueError("--allowed-hosts needs at least one name (or * for any host)")
    return names


def allowed(host: str, names: frozenset[str]) -> bool:
    if ANY_HOST in names or host in names:
        return True
    if "ip" in names:
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            return False
    return False


def _error(status: int, message: str, code: str) -> tuple[int, bytes]:
    return status, json.dumps(ApiError(status, message, code=code).body()).encode()


class SameOrigin:
    """The checks of the module docstring in front of `app`. `hosts`: the names `Host` may
    carry (None: any, for an app that is not listening on a socket, such as a test's);
    `routes`: the paths a trailing-slash redirect may lead to; `refused(path, status)` is told
    of each refusal (the generation endpoints count theirs in /metrics)."""

    def __init__(self, app: ASGIApp, *, hosts: frozenset[str] | None, routes: frozenset[str],
                 refused: Callable[[str, int], None] = lambda path, status: None) -> None:
        self.app, self.hosts, self.routes, self.refused = app, hosts, routes, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.check(scope)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, body = refusal
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if status == 307:
            location = scope["path"].rstrip("/")
            if scope.get("query_string"):
                location += "?" + scope["query_string"].decode("latin-1")
            headers.append((b"location", location.encode("latin-1", "replace")))
        else:
            self.refused(scope["path"], status)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def check(self, scope: Scope) -> tuple[int, bytes] | None:
        """None when the request may go on; else the status and body to answer."""
        headers: dict[bytes, bytes] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k, v)
        host = headers.get(b"host")
        if self.hosts is not None and host is not None:
            name = host_name(host.decode("latin-1"))
            if not allowed(name, self.hosts):
                return _error(400, "this gateway does not answer to the Host in this request; "
                              "if it is the gateway's name, start it with --allowed-hosts "
                              "naming it", "invalid_host")
        method, path = scope["method"], scope["path"]
        if method not in SAFE_METHODS:
            origin = headers.get(b"origin")
            if origin is not None and not _same_origin(origin.decode("latin-1"), host):
                return _error(403, "a request from a web page of another origin may not "
                              "POST to this gateway (its Origin header names another site)",
                              "cross_origin")
            if path in ADMIN_PATHS:
                kind = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
                if kind != b"application/json":
                    return _error(415, f"{path} takes a JSON body: send it with "
                                  "Content-Type: application/json", "unsupported_media_type")
        if path != "/" and path.endswith("/") and path.rstrip("/") in self.routes:
            return 307, b""
        return None


def _same_origin(origin: str, host: bytes | None) -> bool:
    """Whether an Origin header names the origin the request was sent to (its Host); the
    scheme is not compared (a TLS proxy in front makes it https)."""
    if host is None or origin.strip().lower() == "null":
        return False
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return False
    want = host.decode("latin-1").strip().lower()
    want_name = host_name(want)
    want_port = want.rsplit(":", 1)[1] if want.rsplit("]", 1)[-1].count(":") == 1 else None
    if want_port is not None and not want_port.isdigit():
        return False
    return host_name(parts.hostname) == want_name and \
        (port == int(want_port) if want_port is not None else port in (80, 443))
