"""Services as subprocesses: statesvc, replicas and the gateway on loopback ports, each
started until its READY line and stopped by pid, and whether a pid still runs. `make demo`,
`make up` and `loractl drill` start their processes with it; the testkit (testkit/fleet.py)
starts the tests' and benchmarks' fleets over it."""
from __future__ import annotations

import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, Sequence

from shared.replica_protocol import STATUS

BIN = Path(sys.executable).parent


_LOWEST_PORT = 10000
_WORKER_SLABS = 8  # pytest-xdist workers gw0..gw6 get a slab each; everything else slab 0
# "I/N": this process family takes the I-th of N equal shares of its slab. Processes that run side
# by side under one worker (the quick bench suite's benchmarks, each starting fleets of its own)
# would otherwise pick from one slab at random, and one could take a port another had picked
# for a replica that binds it only once its model is loaded
PORT_SHARE_ENV = "LORAPLANE_PORT_SHARE"
_issued: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slab() -> range:
    """This process's share of the ports below the kernel's ephemeral range. A port from that
    range (what binding port 0 gives) can be taken by any outgoing connection between a
    service's stop and its restart on the same address, and two test workers picking at once
    can collide; below the range, split by worker, only this process's family picks."""
    start = _ephemeral_start()
    if start - _LOWEST_PORT < 1000 * _WORKER_SLABS:
        return range(0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker[2:].isdigit() else 0
    size = (start - _LOWEST_PORT) // _WORKER_SLABS
    first = _LOWEST_PORT + (index % _WORKER_SLABS) * size
    share, _, shares = os.environ.get(PORT_SHARE_ENV, "").partition("/")
    if share.isdigit() and shares.isdigit() and 0 <= int(share) < int(shares) <= size:
        size //= int(shares)
        first += int(share) * size
    return range(first, first + size)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now and this process has not
    handed out before: a random one from this process's slab below the ephemeral range
    (`_slab`), or the kernel's pick where that range leaves no room below it."""
    slab = _slab()
    for _ in range(200):
        if not slab:
            break
        port = random.choice(slab)
        if port not in _issued and _bindable(port):
            _issued.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback(port: int | None = None) -> str:
    return f"tcp://127.0.0.1:{port or free_port()}"


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, killed and not yet reaped, is not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def start_ready(argv: Sequence[str], *, log: Path, env: dict[str, str] | None = None,
                timeout: float = 60.0) -> tuple[subprocess.Popen[Any], str]:
    """Start a service that prints a `READY ...` line on stdout; returns it and that line."""
    log_file: IO[bytes] = log.open("ab")
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=log_file,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            break
    if not line.startswith(b"READY"):
        stop_pid(proc)
        raise RuntimeError(f"{Path(argv[0]).name} did not start (exit {proc.poll()}); "
                           f"see {log}:\n{log.read_text()[-2000:]}")
    return proc, line.decode().strip()


def stop_pid(proc: subprocess.Popen[Any], *, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; always reaps."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
        except ProcessLookupError:
            pass
    if proc.stdout is not None:
        proc.stdout.close()



class _Process:
    """Stop (SIGTERM, then SIGKILL) or kill a started service, always by its pid."""

    proc: subprocess.Popen[Any] | None
    ready: str  # its READY line, once started

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@dataclass
class StateSvc(_Process):
    data_dir: Path
    control: str = field(default_factory=loopback)
    publish: str = field(default_factory=loopback)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    wrapper: tuple[str, ...] = ()  # a command that execs statesvc (setpriv, prlimit ...)
    log_file: Path | None = None  # default: statesvc-DATA.log beside the data dir
    proc: subprocess.Popen[Any] | None = None
    ready: str = ""

    @property
    def log(self) -> Path:
        return self.log_file or self.data_dir.parent / f"statesvc-{self.data_dir.name}.log"

    def start(self) -> StateSvc:
        self.proc, self.ready = start_ready(
            [*self.wrapper, str(BIN / "statesvc"), "serve", "--data-dir", str(self.data_dir),
             "--control", self.control, "--publish", self.publish, *self.extra_args],
            log=self.log, env=self.env)
        return self


class Addresses(Protocol):
    """Where a replica finds statesvc: a StateSvc started here, or `Endpoints` of another."""

    @property
    def control(self) -> str: ...

    @property
    def publish(self) -> str: ...


@dataclass(frozen=True)
class Endpoints:
    control: str
    publish: str


@dataclass
class Computed(_Process):
    """A `computed serve` subprocess following `state`."""

    model_dir: Path
    state: Addresses
    cache_dir: Path
    listen: str = field(default_factory=loopback)
    replica_id: str | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    wrapper: tuple[str, ...] = ()  # a command that execs computed (`ip netns exec NS` ...)
    log_file: Path | None = None  # default: computed-CACHE.log beside the cache dir
    proc: subprocess.Popen[Any] | None = None
    ready: str = ""

    @property
    def log(self) -> Path:
        return self.log_file or self.cache_dir.parent / f"computed-{self.cache_dir.name}.log"

    def start(self) -> Computed:
        self.cache_dir.parent.mkdir(parents=True, exist_ok=True)
        self.proc, self.ready = start_ready(
            [*self.wrapper, str(BIN / "computed"), "serve", "--model", str(self.model_dir),
             "--state",
             self.state.control, "--diffs", self.state.publish, "--listen", self.listen,
             "--cache-dir", str(self.cache_dir),
             *(["--replica-id", self.replica_id] if self.replica_id else []),
             *self.extra_args],
            log=self.log, env=self.env)
        return self

    def call(self, cmd: str, **args: Any) -> Any:
        from shared.client import ControlClient
        with ControlClient(self.listen, timeout_s=10, retries=0) as c:
            return c.call(cmd, args)

    def status(self) -> dict[str, Any]:
        return dict(self.call(STATUS))


def wait_for(predicate: Any, *, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll until `predicate()` is true; a generous bound that only guards against hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Gateway(_Process):
    """A `computed gateway` subprocess in front of `state`'s replicas, on a free port."""

    model_dir: Path
    state: Addresses
    log_file: Path
    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    wrapper: tuple[str, ...] = ()  # a command that execs the gateway (`taskset -c 1` ...)
    proc: subprocess.Popen[Any] | None = None
    ready: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.log_file

    def healthy(self) -> bool:
        """Whether its /health answers 200 (a replica is ready behind it)."""
        import httpx
        return httpx.get(self.url + "/health").status_code == 200

    def start(self) -> Gateway:
        self.proc, self.ready = start_ready(
            [*self.wrapper, str(BIN / "computed"), "gateway", "--model", str(self.model_dir), "--state",
             self.state.control, "--port", str(self.port), "--poll-interval", "0.2",
             *self.extra_args], log=self.log_file)
        return self
