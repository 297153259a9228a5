"""The gateway's HTTP connections: uvicorn's httptools protocol with the limits a server
facing untrusted clients needs and uvicorn does not have (docs/security.md, "Gateway HTTP").

uvicorn bounds none of a request head: httptools (llhttp) keeps each header's name and value
by concatenating the pieces it is fed, so one 200 MiB header costs time quadratic in its
size, and its heads are held in memory whole. Nor does it time a head or a body out: its
keep-alive timer is cancelled by any byte, so a client dribbling a byte a second holds its
connection (and a file descriptor) forever. `LimitedHttpTools` is that protocol with:

- `max_head_bytes`: the request line and headers together; the parser is fed a head at most
  this far, so it never holds more, and a longer head is answered 431;
- `max_headers`: header lines per request, 431 beyond;
- `head_timeout_s`: a head must arrive whole within this of the connection opening or of
  the previous answer ending (an idle keep-alive connection is closed by uvicorn's
  `timeout_keep_alive` first); else 408, and the connection is closed;
- `max_connections`: connections open at once; the next one is answered 503 and closed at
  once, so its descriptor is free again.

The body's own timeout is the app's (`gateway/app.py` `read_body`, --body-timeout): the app
reads every body it uses, and a body it does not read is discarded by uvicorn as it comes,
under the next head's timeout. Each refusal closes the connection; none is logged alone
(`shared/lograte.py` rate-limits what is).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import ApiError
from shared.config import (GATEWAY_HEAD_TIMEOUT_S, GATEWAY_MAX_CONNECTIONS,
                           GATEWAY_MAX_HEAD_BYTES, GATEWAY_MAX_HEADERS)

# a refused connection is read (and what comes discarded) this long after its answer before
# it is closed: closing a socket with unread bytes resets it, and the reset can destroy the
# answer before the client reads it
LINGER_S = 1.0


@dataclass(frozen=True)
class HttpLimits:
    """What one connection may cost (the module docstring says what each bounds)."""

    max_head_bytes: int = GATEWAY_MAX_HEAD_BYTES
    max_headers: int = GATEWAY_MAX_HEADERS
    head_timeout_s: float = GATEWAY_HEAD_TIMEOUT_S
    max_connections: int = GATEWAY_MAX_CONNECTIONS


def refusal(status: int, phrase: str, message: str, code: str) -> bytes:
    """A whole HTTP response, OpenAI's error shape, that closes the connection."""
    body = json.dumps(ApiError(status, message, code=code).body()).encode()
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class _TooManyHeaders(Exception):
    """Raised from the parser's header callback: it stops the parse there."""


class LimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol under `limits` (set by `limited_protocol`)."""

    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # the parser is inside a request head
        self._head_bytes = 0  # bytes fed to it since this head began
        self._header_count = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._since_armed = 0  # bytes received since the head timer was armed
        self._refused = False

    # ---- the connection ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections
        if len(self.connections) > cap:  # closed at once: a lingering one would hold its fd
            self._refuse(refusal(503, "Service Unavailable", f"the gateway has {cap} "
                                 "connections open (--max-connections); retry later",
                                 "too_many_connections"), linger=False)
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _refuse(self, response: bytes | None, *, linger: bool = True) -> None:
        """Answer `response` unless an answer is being written (a pipelined request), and
        close the connection: after LINGER_S, reading and discarding what still comes, so
        that the client reads the answer (`linger`), else at once."""
        self._refused = True
        self._disarm_head_timer()
        if self.transport.is_closing():
            return
        if response is None or not (self.cycle is None or self.cycle.response_complete):
            self.transport.close()
            return
        self.transport.write(response)
        if not linger or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()  # paused under a body nobody read
        self.loop.call_later(LINGER_S, self.transport.close)

    # ---- the head: its size, its headers, its time -----------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        self._since_armed += len(data)
        while data:
            if self._in_head:  # feed the parser no more of a head than the limit
                room = self.limits.max_head_bytes - self._head_bytes
                if room <= 0:
                    return self._refuse(refusal(
                        431, "Request Header Fields Too Large", f"the request head is larger "
                        f"than {self.limits.max_head_bytes} bytes (--max-head-bytes); send "
                        "shorter headers", "head_too_large"))
                piece, data = data[:room], data[room:]
                self._head_bytes += len(piece)
            else:
                piece, data = data, b""
            if not self._feed(piece):
                return

    def _feed(self, piece: bytes) -> bool:
        """Feed the parser; False once the connection is refused or given to a websocket."""
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        except httptools.HttpParserError:
            if self._header_count > self.limits.max_headers:
                self._refuse(refusal(431, "Request Header Fields Too Large", f"the request "
                                     f"has more than {self.limits.max_headers} headers "
                                     "(--max-headers)", "too_many_headers"))
            else:
                self.logger.warning("Invalid HTTP request received.")  # uvicorn's words
                self._refused = True
                self._disarm_head_timer()
                self.send_400_response("Invalid HTTP request received.")
            return False
        return not self._refused

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            raise _TooManyHeaders
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._header_count = True, 0, 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # the next head's time starts now, unless a pipelined request has just started
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._since_armed = 0
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_late)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        """No whole head within the head timeout: 408 when bytes came meanwhile (part of a
        head, or the rest of a body the app did not read), else just close."""
        self._head_timer = None
        if self.transport.is_closing():
            return
        self._refuse(refusal(408, "Request Timeout", f"the request head did not arrive "
                             f"within {self.limits.head_timeout_s:g} s (--head-timeout)",
                             "timeout") if self._since_armed else None)


def limited_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """The protocol class for uvicorn's `http` setting, under `limits`."""
    return type("GatewayHttp", (LimitedHttpTools,), {"limits": limits})


def descriptors_for_connections(max_connections: int, reserve: int) -> int:
    """The connections the file-descriptor limit leaves room for, at most `max_connections`,
    after `reserve` descriptors for everything else (the replicas' and statesvc's sockets):
    RLIMIT_NOFILE's soft limit is raised first as far as both need, within the hard limit.
    A cap above what the descriptors allow caps nothing: accepting fails instead, for good
    clients and bad alike."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + reserve
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(0, min(max_connections, soft - reserve))
