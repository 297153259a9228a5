"""CurveZMQ keys: who may talk to statesvc and replicas, and as what.

A key directory made by `statesvc keys init DIR` holds the server's key pair
(`server.key`, `server.key_secret`) and folders of allowed client public
keys: `operators/` (may issue commands) and `replicas/` (may read the log and
blobs and heartbeat) for statesvc; `clients/` and `operators/` for a replica's inference
socket when the replica runs with `--auth DIR`, and `replicas/` there for peers fetching the
blobs it holds (`blob` and `status` only). A client's identity on the wire is `ROLE:NAME`, NAME
being its certificate's file stem; every event records it as its actor.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from shared.files import FileError, read_regular

log = logging.getLogger("keys")

ROLES = ("operators", "replicas")  # statesvc's control and diff sockets
INFERENCE_ROLES = ("clients", "operators", "replicas")  # a replica's listen socket
KEY_ENV, SERVER_KEY_ENV = "LORAPLANE_KEY", "LORAPLANE_SERVER_KEY"
MAX_KEY_FILE_BYTES = 64 << 10  # a certificate is ~300 bytes


class KeyError_(ValueError):
    """A key file that is missing or unreadable."""


@dataclass(frozen=True)
class ClientKeys:
    """What a client needs to talk CURVE: its key pair and the server's public key."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError, IndexError) as exc:  # IndexError: `public-key` without =
        raise KeyError_(f"cannot read the key file {path}: {exc}") from None
    if secret and not sec:
        raise KeyError_(f"{path} holds no secret key; pass the *.key_secret file")
    return public, sec


def client_keys(key: str | None, server_key: str | None) -> ClientKeys | None:
    """Keys from --key/--server-key (or LORAPLANE_KEY/LORAPLANE_SERVER_KEY); None for neither."""
    key = key or os.environ.get(KEY_ENV)
    server_key = server_key or os.environ.get(SERVER_KEY_ENV)
    if not key and not server_key:
        return None
    if not (key and server_key):
        raise KeyError_("CURVE needs both --key (your *.key_secret file) and --server-key "
                        "(the server's server.key)")
    public, secret = _load(Path(key), secret=True)
    server, _ = _load(Path(server_key), secret=False)
    assert secret is not None
    return ClientKeys(public, secret, server)


def new_client_keys(directory: Path, name: str) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def init_server_keys(directory: Path) -> tuple[Path, Path]:
    if (directory / "server.key_secret").exists():
        raise KeyError_(f"{directory} already holds a server key; refusing to overwrite it")
    for role in ROLES + INFERENCE_ROLES:
        (directory / role).mkdir(parents=True, exist_ok=True)
    return new_client_keys(directory, "server")


class ServerAuth:
    """Runs the ZAP handler for a context: CURVE, allowed keys by role, re-read per connection
    so keys added to or removed from the folders take effect without a restart."""

    def __init__(self, ctx: zmq.Context[Any], directory: Path,
                 roles: tuple[str, ...] = ROLES) -> None:
        self.directory = directory
        public, secret = _load(directory / "server.key_secret", secret=True)
        assert secret is not None
        self.public, self.secret = public, secret
        auth = _RoleAuthenticator(ctx, directory, roles)
        auth.start()
        auth.configure_curve_callback("*", auth)
        self.auth = auth

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def stop(self) -> None:
        self.auth.stop()


class _RoleAuthenticator(ThreadAuthenticator):
    def __init__(self, ctx: zmq.Context[Any], directory: Path, roles: tuple[str, ...]) -> None:
        super().__init__(ctx)
        self.directory = directory
        self.roles = roles
        self._skipped: dict[Path, tuple[object, ...]] = {}

    def _role_keys(self) -> dict[bytes, str]:
        out = {}
        for role in self.roles:
            for cert in sorted((self.directory / role).glob("*.key")):
                try:
                    public = public_key_of(cert)
                except KeyError_ as exc:  # one bad file must not lock every key out
                    self._skip(cert, str(exc))
                    continue
                out[public] = f"{role.removesuffix('s')}:{cert.stem}"
        return out

    def _skip(self, cert: Path, why: str) -> None:
        """Log a skipped key file once per version of it (keys are re-read per connection)."""
        try:
            st = os.lstat(cert)
            version: tuple[object, ...] = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            version = ()
        if self._skipped.get(cert) != version:
            self._skipped[cert] = version
            log.warning("skipping key file %s: %s", cert, why)

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            return key in self._role_keys()
        except Exception:  # the ZAP thread must survive anything: refuse this one connection
            log.exception("key check failed; connection refused")
            return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        try:
            return self._role_keys().get(z85.encode(client_public_key), "unknown")
        except Exception:
            log.exception("key lookup failed")
            return "unknown"


def public_key_of(cert: Path) -> bytes:
    """The z85 public key of a `*.key` certificate; KeyError_ for anything else (a directory, a
    FIFO, a huge or garbled file, a missing `public-key` line, a key that is not 32 bytes)."""
    try:
        text = read_regular(cert, MAX_KEY_FILE_BYTES)  # a FIFO must not block the ZAP thread
    except FileError as exc:
        raise KeyError_(str(exc)) from None
    except OSError as exc:
        raise KeyError_(f"cannot open it ({exc.strerror})") from None
    for line in text.splitlines():
        name, eq, value = line.strip().partition(b"=")
        if name.strip() == b"public-key" and eq:
            key = value.strip(b" \t'\"")
            try:
                if len(key) == 40 and len(z85.decode(key)) == 32:
                    return key
            except (ValueError, KeyError):  # KeyError: a character outside z85's alphabet
                pass
            raise KeyError_("its public-key is not 40 z85 characters (a 32-byte CURVE key); "
                            "write it again with `loractl keys new`")
    raise KeyError_("no `public-key = \"...\"` line; copy the NAME.key that `loractl keys "
                    "new` wrote")
