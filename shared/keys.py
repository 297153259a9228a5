"""CurveZMQ keys: who may talk to statesvc and replicas, and as what.

A key directory made by `statesvc keys init DIR` holds the server's key pair
(`server.key`, `server.key_secret`) and folders of allowed client public
keys: `operators/` (may issue commands) and `replicas/` (may read the log and
blobs and heartbeat) for statesvc; `clients/` (and `operators/`) for a
replica's inference socket when the replica runs with `--auth DIR`. A client's identity on the wire is `ROLE:NAME`, NAME
being its certificate's file stem; every event records it as its actor.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ROLES = ("operators", "replicas")  # statesvc's control and diff sockets
INFERENCE_ROLES = ("clients", "operators")  # a replica's listen socket
KEY_ENV, SERVER_KEY_ENV = "LORAPLANE_KEY", "LORAPLANE_SERVER_KEY"


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
    except (OSError, ValueError) as exc:
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

    def _role_keys(self) -> dict[bytes, str]:
        out = {}
        for role in self.roles:
            for cert in sorted((self.directory / role).glob("*.key")):
                try:
                    public, _ = zmq.auth.load_certificate(str(cert))
                except (OSError, ValueError):
                    continue
                out[public] = f"{role.removesuffix('s')}:{cert.stem}"
        return out

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._role_keys()

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._role_keys().get(zmq.utils.z85.encode(client_public_key), "unknown")
