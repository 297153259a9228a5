"""The gateway against hostile HTTP clients, on loopback: request heads too large or with too
many headers (431), heads and bodies dribbled a byte at a time (408, the connection closed),
more connections than --max-connections (503), cross-site writes (415, 403) and foreign Host
headers (400, redirects that never name them), malformed requests (logged a few times, not
once each), clients that close mid-body (499, no traceback) and prompts longer than any
context (400 before tokenizing). A real statesvc and gateways (subprocesses); no replica:
/v1/models answers without one, and nothing here generates."""
from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from statesvc.tools.example import ExampleAssets
from testkit.fleet import Gateway, memory_kb, wait_for
from tests.helpers import Fleet

pytestmark = pytest.mark.timeout(180)
HEAD_TIMEOUT_S = BODY_TIMEOUT_S = 1.5
SLOW = 300  # the count of slow or oversized connections at once


@dataclass
class Setup:
    fleet: Fleet
    gateway: Gateway  # --head-timeout and --body-timeout short, the other limits default
    small: Gateway  # --max-connections 16 --allowed-hosts gw.example,127.0.0.1

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.gateway.port


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("limits")
    fleet = Fleet(tmp, example)
    try:
        fleet.statesvc.start()
        fleet.init()
        gateways = [Gateway(example.model_dir, fleet.statesvc, log_file=tmp / f"{name}.log",
                            extra_args=args) for name, args in (
            ("gateway", ("--head-timeout", str(HEAD_TIMEOUT_S),
                         "--body-timeout", str(BODY_TIMEOUT_S))),
            ("small", ("--max-connections", "16", "--allowed-hosts", "gw.example,127.0.0.1")))]
        fleet.gateways.extend(gateways)
        for g in gateways:
            g.start()
        yield Setup(fleet, *gateways)
    finally:
        fleet.stop()


def connect(address: tuple[str, int]) -> socket.socket:
    return socket.create_connection(address, timeout=30)


def answer_of(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a reset ends it too)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def send_all(sock: socket.socket, data: bytes) -> None:
    """Send `data`, or as much of it as the server reads before it closes the connection."""
    try:
        for i in range(0, len(data), 1 << 16):
            sock.sendall(data[i:i + (1 << 16)])
    except (BrokenPipeError, ConnectionResetError):
        pass


def status_and_error(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"] if body else {}


def get(gateway: Gateway, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(gateway.url + path, timeout=30, **kw)


def post(gateway: Gateway, path: str, **kw: Any) -> httpx.Response:
    return httpx.post(gateway.url + path, timeout=30, **kw)


def requests_counted(gateway: Gateway, endpoint: str, status: str) -> float:
    text = get(gateway, "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "loraplane_gateway_requests_total"
               and s.labels == {"model": "", "endpoint": endpoint, "status": status})


# ---- request heads (D1) --------------------------------------------------------------------

def test_a_huge_header_or_too_many_are_431_read_no_further(setup: Setup) -> None:
    start = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    cases = [  # one 8 MiB header: refused at --max-head-bytes (64 KiB), the rest never parsed
             (start + b"X-Big: " + b"a" * (8 << 20) + b"\r\n\r\n", "head_too_large"),
             # 100,000 headers, or 101 in 1 KiB: --max-headers (100)
             (start + b"X-h: 1\r\n" * 100_000 + b"\r\n", "too_many_headers"),
             (start + b"X-h: 1\r\n" * 100 + b"\r\n", "too_many_headers")]
    for request, code in cases:
        with connect(setup.address) as sock:
            send_all(sock, request)
            status, error = status_and_error(answer_of(sock))
        assert (status, error["code"]) == (431, code), (code, status, error)
        assert ("--max-head-bytes" if code == "head_too_large" else "--max-headers") \
            in error["message"]
    # 100 headers are fine
    ok = get(setup.gateway, "/v1/models", headers={f"x-h{i}": "1" for i in range(95)})
    assert ok.status_code == 200


# ---- slow and oversized clients at once (D1, D2) ----------------------------------------------

def test_300_slow_or_oversized_connections_leave_a_good_client_served(setup: Setup) -> None:
    """A third of the connections dribble a head a byte at a time, a third send 60 KiB of a
    header (under the limit) and stop, a third send a whole head and dribble the body. A good
    client is answered throughout, the gateway's memory barely grows, and each bad connection
    is answered 408 and closed once its head or body is late."""
    pid = setup.gateway.pid
    rss_before = memory_kb(pid, "VmRSS")
    body = json.dumps({"model": "model", "prompt": "hi", "max_tokens": 1}).encode()
    openers = [
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"b" * (60 << 10),
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n" % len(body),
    ]
    bad = [connect(setup.address) for _ in range(SLOW)]
    answers: dict[int, bytes] = {}
    good_ms: list[float] = []
    rss_peak = rss_before
    try:
        for i, sock in enumerate(bad):
            sock.sendall(openers[i % 3])
            sock.setblocking(False)
        deadline = time.monotonic() + 3 * (HEAD_TIMEOUT_S + BODY_TIMEOUT_S) + 20
        with httpx.Client(base_url=setup.gateway.url, timeout=30) as good:
            while len(answers) < SLOW and time.monotonic() < deadline:
                for i, sock in enumerate(bad):
                    if i in answers:
                        continue
                    try:
                        answers[i] = sock.recv(65536)  # its answer, or b"" for a bare close
                        continue
                    except BlockingIOError:
                        pass
                    except OSError as exc:
                        answers[i] = repr(exc).encode()
                        continue
                    if i % 3 != 1:
                        try:
                            sock.send(b"x")  # one byte more of its head or body
                        except OSError:
                            pass
                t0 = time.perf_counter()
                assert good.get("/v1/models").status_code == 200  # keep-alive
                assert get(setup.gateway, "/v1/models").status_code == 200  # a new connection
                good_ms.append((time.perf_counter() - t0) * 1e3)
                rss_peak = max(rss_peak, memory_kb(pid, "VmRSS"))
                time.sleep(0.1)
    finally:
        for sock in bad:
            sock.close()
    assert len(answers) == SLOW, f"{SLOW - len(answers)} slow connections still open"
    statuses = {i: status_and_error(a)[0] if a.startswith(b"HTTP/1.1") else a[:40]
                for i, a in answers.items()}
    assert set(statuses.values()) == {408}, {v for v in statuses.values() if v != 408}
    grown_mb = (rss_peak - rss_before) / 1024
    assert grown_mb < 100, f"the gateway's RSS grew {grown_mb:.0f} MB"
    print(f"good client: {len(good_ms)} pairs of requests, the slowest {max(good_ms):.1f} ms; "
          f"RSS +{grown_mb:.1f} MB")
    # the body dribblers' 408s were answered by the app: counted
    assert requests_counted(setup.gateway, "/v1/completions", "408") >= SLOW // 3


def test_connections_past_max_connections_are_503_and_closed(setup: Setup) -> None:
    address = ("127.0.0.1", setup.small.port)
    held = [connect(address) for _ in range(16)]
    try:
        wait_for(lambda: get(setup.small, "/health").status_code in (200, 503),
                 what="the gateway to answer")  # each held connection accepted meanwhile
        with connect(address) as extra:
            status, error = status_and_error(answer_of(extra))
        assert (status, error["code"]) == (503, "too_many_connections")
        assert "--max-connections" in error["message"]
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: get(setup.small, "/v1/models").status_code == 200,
             what="a connection once the others closed")


# ---- cross-site writes and Host (D3) --------------------------------------------------------

def test_cross_site_writes_and_foreign_hosts_are_refused(setup: Setup) -> None:
    gw, head = setup.gateway, setup.fleet.head()
    load = {"lora_name": "x", "lora_path": "/nowhere"}
    raw = json.dumps(load)
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        r = post(gw, "/v1/load_lora_adapter", content=raw,
                 headers={} if kind is None else {"content-type": kind})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    for origin in ("http://evil.example", f"http://evil.example:{gw.port}", "null",
                   f"http://localhost:{gw.port}"):
        r = post(gw, "/v1/load_lora_adapter", json=load, headers={"origin": origin})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "cross_origin"), origin
    before = requests_counted(gw, "/v1/completions", "403")
    r = post(gw, "/v1/completions", json={"model": "model", "prompt": "hi"},
             headers={"origin": "http://evil.example"})
    assert r.status_code == 403
    assert requests_counted(gw, "/v1/completions", "403") == before + 1
    assert setup.fleet.head() == head  # nothing reached statesvc
    # its own origin, and no origin (a client that is not a browser), go through to statesvc
    for headers in ({"origin": f"http://127.0.0.1:{gw.port}"}, {}):
        r = post(gw, "/v1/load_lora_adapter", json=load, headers=headers)
        assert r.json()["error"]["code"] == "invalid_adapter", r.text  # statesvc's answer
    # Host: a rebound name is refused, the gateway's own names are served
    for path in ("/v1/models", "/metrics", "/v1/models/"):
        r = get(gw, path, headers={"host": "evil.example"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_host"), path
        assert "evil.example" not in r.text
    for host in (f"localhost:{gw.port}", f"127.0.0.1:{gw.port}", "LOCALHOST"):
        assert get(gw, "/v1/models", headers={"host": host}).status_code == 200
    # a trailing slash is redirected by path alone
    r = get(gw, "/v1/models/?x=1", follow_redirects=False)
    assert (r.status_code, r.headers["location"]) == (307, "/v1/models?x=1")
    # --allowed-hosts replaces the defaults
    assert get(setup.small, "/v1/models", headers={"host": "gw.example"}).status_code == 200
    assert get(setup.small, "/v1/models", headers={"host": "localhost"}).status_code == 400


# ---- the log and clients that leave (D9, D12) -----------------------------------------------

def test_malformed_requests_are_logged_a_few_times_not_once_each(setup: Setup) -> None:
    log = setup.gateway.log.read_text()
    logged = log.count("Invalid HTTP request received.")
    for _ in range(50):
        with connect(setup.address) as sock:
            send_all(sock, b"GET /\x00 HTTP/1.1\r\n\r\n")
            assert answer_of(sock).startswith(b"HTTP/1.1 400")
    time.sleep(0.2)  # the gateway's stderr is written as it logs
    more = setup.gateway.log.read_text().count("Invalid HTTP request received.") - logged
    assert 1 <= more <= 5, f"{more} lines for 50 malformed requests"


def test_a_client_that_closes_mid_body_is_a_499_with_no_traceback(setup: Setup) -> None:
    gw = setup.gateway
    for path in ("/v1/completions", "/v1/load_lora_adapter"):
        before = requests_counted(gw, "/v1/completions", "499")
        with connect(setup.address) as sock:
            sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": "
                         % path.encode())
            time.sleep(0.2)  # the handler waits for the rest of the body
        if path == "/v1/completions":
            wait_for(lambda: requests_counted(gw, path, "499") == before + 1,
                     what="the gateway to count the request")
    wait_for(lambda: setup.gateway.log.read_text().count(
        "closed the connection before the end of its body") >= 2, what="the log lines")
    log = setup.gateway.log.read_text()
    assert "Traceback" not in log and "request failed" not in log
    assert requests_counted(gw, "/v1/completions", "500") == 0


# ---- prompts no context holds (D5) ----------------------------------------------------------

def test_a_prompt_longer_than_any_context_is_refused_by_its_length(setup: Setup) -> None:
    for path, body, param in (
            ("/v1/completions", {"model": "model", "prompt": "word " * 50_000}, "prompt"),
            ("/v1/chat/completions", {"model": "model", "messages": [
                {"role": "user", "content": "word " * 50_000}]}, "messages")):
        r = post(setup.gateway, path, json=body)
        error = r.json()["error"]
        assert (r.status_code, error["code"], error["param"]) == (
            400, "context_length_exceeded", param), r.text
        assert "250000" in error["message"] and "characters" in error["message"]
