"""Addresses and memory bounds on the wire, through the real CLIs and real services.

- Without --auth, `statesvc serve` and `computed serve --listen` bind one plain loopback
  endpoint or refuse to start, saying what is wrong and what to do; malformed addresses to
  connect to are usage errors, not libzmq tracebacks.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shared.client import ControlClient
from statesvc.example import ExampleAssets
from tests.procs import BIN, Computed, StateSvc, free_port

pytestmark = pytest.mark.timeout(240)


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=60)


# ---- endpoints -----------------------------------------------------------------------------

# (address, what the refusal must say); {p} and {q} are free ports
NOT_LOOPBACK = {
    "source;bind": ("tcp://127.0.0.1:{p};0.0.0.0:{q}", "has a ';'"),
    "0.0.0.0": ("tcp://0.0.0.0:{p}", "0.0.0.0 binds every interface"),
    "*": ("tcp://*:{p}", "* binds every interface"),
    "[::]": ("tcp://[::]:{p}", ":: binds every interface"),
    "lo": ("tcp://lo:{p}", "lo is an interface name"),
    "eth0": ("tcp://eth0:{p}", "eth0 is an interface name"),
    "routable": ("tcp://10.1.2.3:{p}", "10.1.2.3 is not loopback"),
    "trailing path": ("tcp://127.0.0.1:{p}/x", "is not HOST:PORT"),
    "trailing space": ("tcp://127.0.0.1:{p} ", "is not HOST:PORT"),
    "short ipv4": ("tcp://127.1:{p}", "is not an IPv4 address"),
    "port range": ("tcp://127.0.0.1:70000", "port must be between 0 and 65535"),
    "no scheme": ("127.0.0.1:{p}", "is not a tcp:// or ipc:// address"),
    "inproc": ("inproc://control", "is not a tcp:// or ipc:// address"),
}


def _address(template: str) -> str:
    return template.format(p=free_port(), q=free_port())


def assert_refused(res: subprocess.CompletedProcess[str], flag: str, says: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)  # a usage error
    assert flag in res.stderr and says in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("case", NOT_LOOPBACK)
def test_statesvc_binds_only_plain_loopback_without_auth(tmp_path: Path, case: str) -> None:
    template, says = NOT_LOOPBACK[case]
    data = tmp_path / "data"
    res = run("statesvc", "serve", "--data-dir", str(data), "--control", _address(template),
              "--publish", f"tcp://127.0.0.1:{free_port()}")
    assert_refused(res, "--control", says)
    if "not loopback" in says or "every interface" in says or "interface name" in says:
        assert "bind loopback" in res.stderr and "--auth DIR" in res.stderr, res.stderr
    assert not (data / "state.db").exists()  # refused before the log is touched
    res = run("statesvc", "serve", "--data-dir", str(data), "--control",
              f"tcp://127.0.0.1:{free_port()}", "--publish", _address(template))
    assert_refused(res, "--publish", says)


@pytest.mark.parametrize("case", ["source;bind", "0.0.0.0", "*", "[::]", "lo", "eth0",
                                  "trailing path"])
def test_replica_listens_only_on_plain_loopback_without_auth(
        tmp_path: Path, example: ExampleAssets, case: str) -> None:
    template, says = NOT_LOOPBACK[case]
    res = run("computed", "serve", "--model", str(example.model_dir), "--listen",
              _address(template), "--cache-dir", str(tmp_path / "cache"), "--no-warmup")
    assert_refused(res, "--listen", says)


@pytest.mark.parametrize("argv, flag", [
    (("loractl", "--state", "tcp://127.0.0.1:7100;10.0.0.1:7100", "list"), "--state"),
    (("loractl", "--state", "tcp://127.0.0.1", "list"), "--state"),
    (("loractl", "--state", "tcp://127.0.0.1:0", "list"), "--state"),
    (("loractl", "events", "--follow", "--diffs", "tcp://[::1:7101"), "--diffs"),
    (("loractl", "generate", "--replica", "tcp://host name:7200", "--input-ids", "1"),
     "--replica"),
    (("computed", "serve", "--model", ".", "--state", "udp://127.0.0.1:7100"), "--state"),
    (("computed", "serve", "--model", ".", "--diffs", "tcp://127.0.0.1:7101 x"), "--diffs"),
])
def test_malformed_connect_addresses_are_usage_errors(argv: tuple[str, ...], flag: str) -> None:
    res = run(*argv)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert f"Invalid value for '{flag}'" in res.stderr and "Traceback" not in res.stderr, \
        res.stderr


def test_loopback_forms_and_authenticated_wildcards_start(tmp_path: Path,
                                                         example: ExampleAssets) -> None:
    """localhost, [::1] and ipc:// start without --auth (and clients reach them); with --auth
    a wildcard bind is allowed."""
    port = free_port()
    svc = StateSvc(tmp_path / "a", control=f"tcp://[::1]:{port}",
                   publish=f"ipc://{tmp_path}/diffs.sock")
    other = StateSvc(tmp_path / "b", control=f"tcp://localhost:{free_port()}")
    keydir = tmp_path / "keys"
    assert run("statesvc", "keys", "init", str(keydir)).returncode == 0
    keyed = StateSvc(tmp_path / "c", control=f"tcp://*:{free_port()}",
                     publish=f"tcp://0.0.0.0:{free_port()}", extra_args=("--auth", str(keydir)))
    replica = Computed(example.model_dir, svc, tmp_path / "replicas" / "r", replica_id="r",
                       listen=f"tcp://[::1]:{free_port()}",
                       extra_args=("--no-warmup", "--no-inference"))
    try:
        for s in (svc, other, keyed):
            s.start()
        for s in (svc, other):
            with ControlClient(s.control, timeout_s=20, retries=0) as c:
                assert c.call("status")["head_seq"] == 0
        res = run("loractl", "--state", svc.control, "status", "--json")
        assert res.returncode == 0, res.stderr
        replica.start()
        assert replica.status()["id"] == "r"
    finally:
        replica.stop()
        for s in (svc, other, keyed):
            s.stop()
