"""What the CLIs say when they cannot start or cannot send what they were given: one line that
names the flag, what is wrong and what to do, exit 2 (a usage error), never a traceback."""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Iterator

import msgpack
import pytest
import zmq

from shared.client import ControlClient, Unsendable
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, StateSvc, loopback

BIG = str(2**64 + 1)  # beyond what msgpack encodes


def run(*argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """One of the real CLIs; killed (by run, by its pid) if it outlives `timeout`."""
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=timeout)


def usage_error(res: subprocess.CompletedProcess[str], *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in res.stderr, res.stderr


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port that a plain socket holds (bound and listening) for the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


IN_USE = "address already in use; stop what holds it or choose another port"


@pytest.mark.parametrize("flag", ["--control", "--publish"])
def test_statesvc_address_in_use(tmp_path: Path, held_port: int, flag: str) -> None:
    held = f"tcp://127.0.0.1:{held_port}"
    addresses = {"--control": loopback(), "--publish": loopback(), flag: held}
    res = run("statesvc", "serve", "--data-dir", str(tmp_path / "data"),
              *(a for pair in addresses.items() for a in pair), timeout=60)
    usage_error(res, f"{flag} {held}: {IN_USE}")


def test_statesvc_same_address_twice(tmp_path: Path) -> None:
    address = loopback()
    res = run("statesvc", "serve", "--data-dir", str(tmp_path / "data"), "--control", address,
              "--publish", address, timeout=60)
    usage_error(res, f"--control and --publish are both {address}")


@pytest.mark.parametrize("where", ["/proc/nope", "FILE/sub"])
def test_statesvc_data_dir_unusable(tmp_path: Path, where: str) -> None:
    (tmp_path / "FILE").write_text("")
    data_dir = where.replace("FILE", str(tmp_path / "FILE"))
    res = run("statesvc", "serve", "--data-dir", data_dir, "--control", loopback(),
              "--publish", loopback(), timeout=60)
    usage_error(res, f"--data-dir {data_dir}: ", "choose a directory this user can create")


def test_computed_listen_in_use(tmp_path: Path, example: ExampleAssets, held_port: int) -> None:
    held = f"tcp://127.0.0.1:{held_port}"
    res = run("computed", "serve", "--model", str(example.model_dir), "--state", loopback(),
              "--diffs", loopback(), "--listen", held, "--replica-id", "r1", "--cache-dir",
              str(tmp_path / "cache"), "--no-inference", "--no-heartbeat")
    usage_error(res, f"--listen {held}: {IN_USE}")


def test_gateway_port_in_use(example: ExampleAssets, held_port: int) -> None:
    res = run("computed", "gateway", "--model", str(example.model_dir), "--state", loopback(),
              "--port", str(held_port))
    usage_error(res, f"--host 127.0.0.1 --port {held_port}: {IN_USE} (--port 0 picks a free one)")


@pytest.mark.parametrize("where", ["/proc/nope", "FILE/sub"])
def test_make_example_unwritable(tmp_path: Path, where: str) -> None:
    (tmp_path / "FILE").write_text("")
    directory = where.replace("FILE", str(tmp_path / "FILE"))
    res = run("loractl", "make-example", directory)
    usage_error(res, f"DIRECTORY {directory}: ", "choose a directory this user can create")


@pytest.mark.parametrize("args, option", [
    (["load", "a", "DIR", "--expect-head", BIG], "'--expect-head'"),
    (["unload", "a", "--expect-head", BIG], "'--expect-head'"),
    (["events", "--since", BIG], "'--since'"),
    (["generate", "--input-ids", "1,2", "--seed", BIG], "'--seed'"),
    (["generate", "--input-ids", "1,2", "--min-seq", BIG], "'--min-seq'"),
    (["generate", "--input-ids", "1,2", "--max-new-tokens", BIG], "'--max-new-tokens'"),
    (["generate", "--input-ids", f"1,{BIG}"], "--input-ids"),
    (["generate", "--input-ids", "1,-1"], "--input-ids"),
    (["generate", "--input-ids", "1", "--stop-token-ids", BIG], "--stop-token-ids"),
    (["generate", "--input-ids", "1", "--temperature", "nan"], "'--temperature'"),
    (["generate", "--input-ids", "1", "--top-p", "nan"], "'--top-p'"),
    (["--timeout", "inf", "status"], "'--timeout'"),
    (["--timeout", "nan", "status"], "'--timeout'"),
    (["make-example", "DIR/ex", "--seed", "-1"], "'--seed'"),
])
def test_loractl_numbers_out_of_range(tmp_path: Path, args: list[str], option: str) -> None:
    """Refused before anything is sent (no service runs here): the option and its range."""
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    if args[0] == "generate":
        args[1:1] = ["--replica", loopback()]
    res = run("loractl", "--state", loopback(), *args, timeout=60)
    usage_error(res, f"Invalid value for {option}")


@pytest.mark.parametrize("args, named", [
    (["load", "ab\udcff", "DIR"], "'NAME': 'ab\\udcff' is not valid UTF-8"),
    (["load", "a", "DIR/ad\udcff"], "'PATH': "),
    (["unload", "ab\udcff"], "'NAME': "),
    (["list", "--after", "ab\udcff"], "'--after': "),
    (["generate", "--input-ids", "1", "--adapter", "ab\udcff"], "'--adapter': "),
    (["pool", "init", "--model", "DIR/ad\udcff", "--max-loras", "2", "--max-rank", "8",
      "--targets", "all"], "'--model': "),
])
def test_loractl_text_not_utf8(tmp_path: Path, args: list[str], named: str) -> None:
    """Bytes that are not UTF-8 (argv reaches Python with them as surrogates) cannot go on the
    wire: a usage error naming the argument."""
    (tmp_path / "ad\udcff").mkdir()
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    if args[0] == "generate":
        args[1:1] = ["--replica", loopback()]
    res = run("loractl", "--state", loopback(), *args, timeout=60)
    usage_error(res, f"Invalid value for {named}", "not valid UTF-8")


@pytest.mark.parametrize("args, why", [
    ({"name": "a\udcff"}, "args.name ('a\\udcff') is not valid UTF-8 text"),
    ({"expect_head": 2**64}, "args.expect_head is an integer beyond 64 bits"),
    ({"ids": [1, -(2**70)]}, "args.ids[1] is an integer beyond 64 bits"),
])
def test_client_refuses_what_it_cannot_encode(args: dict[str, object], why: str) -> None:
    """Nothing is sent (no service listens here), and the message names the argument."""
    with ControlClient(loopback(), timeout_s=0.2, retries=0) as c:
        with pytest.raises(Unsendable) as info:
            c.call("load", args)
    assert str(info.value) == f"cannot send load: {why}"


def test_empty_request_id_is_answered_with_null(tmp_path: Path) -> None:
    """docs/protocol.md §4: an id is 1 to 64 characters, and an invalid one is answered
    with id null, never echoed."""
    svc = StateSvc(tmp_path / "data")
    try:
        svc.start()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(svc.control)
        try:
            replies = []
            for req_id in ("", "x" * 65, "ok-id"):
                sock.send(msgpack.packb({"v": 1, "id": req_id, "cmd": "status"}))
                assert sock.poll(10_000), "no reply"
                replies.append(msgpack.unpackb(sock.recv()))
        finally:
            sock.close(0)
    finally:
        svc.stop()
    empty, too_long, ok = replies
    assert empty["id"] is None and empty["ok"] is False
    assert empty["error"]["code"] == "bad_request" and empty["error"]["field"] == "request.id"
    assert too_long["id"] is None and too_long["ok"] is False
    assert ok["id"] == "ok-id" and ok["ok"] is True


def _auth_dirs(root: Path) -> dict[str, Path]:
    """--auth dirs that hold no usable server key: what each lacks."""
    from shared.keys import init_server_keys
    init_server_keys(root / "keys")
    dirs = {name: root / name for name in ("empty", "garbage", "public-only")}
    for d in dirs.values():
        d.mkdir()
    (dirs["garbage"] / "server.key_secret").write_text("junk\n")
    (dirs["public-only"] / "server.key").write_bytes((root / "keys" / "server.key").read_bytes())
    return dirs


AUTH_WHY = {"empty": "server.key_secret does not exist",
            "garbage": 'server.key_secret has no `public-key = "..."` line',
            "public-only": "holds server.key, the public half only"}


@pytest.mark.parametrize("which", sorted(AUTH_WHY))
def test_statesvc_auth_dir_without_server_key(tmp_path: Path, which: str) -> None:
    """Refused before the data dir is created or a schema touched: the file and the fix."""
    auth = _auth_dirs(tmp_path)[which]
    res = run("statesvc", "serve", "--data-dir", str(tmp_path / "data"), "--control",
              loopback(), "--publish", loopback(), "--auth", str(auth), timeout=60)
    usage_error(res, f"--auth {auth}: ", AUTH_WHY[which], "statesvc keys init DIR")
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("which", ["empty", "public-only"])
def test_computed_auth_dir_without_server_key(tmp_path: Path, example: ExampleAssets,
                                              which: str) -> None:
    dirs = _auth_dirs(tmp_path)
    res = run("computed", "serve", "--model", str(example.model_dir), "--state", loopback(),
              "--diffs", loopback(), "--replica-id", "r1", "--cache-dir", str(tmp_path / "c"),
              "--no-inference", "--no-heartbeat", "--auth", str(dirs[which]),
              "--key", str(tmp_path / "keys" / "server.key_secret"),
              "--server-key", str(tmp_path / "keys" / "server.key"))
    usage_error(res, f"--auth {dirs[which]}: ", AUTH_WHY[which])
    assert not (tmp_path / "c").exists()


def test_missing_client_key_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "me.key_secret"
    res = run("loractl", "--state", loopback(), "--key", str(missing), "--server-key",
              str(missing), "status", timeout=60)
    usage_error(res, f"key file {missing} does not exist", "loractl keys new NAME")
