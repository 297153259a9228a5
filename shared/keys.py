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

import click
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from shared.files import FileError, read_regular
from shared.protocol import COMMANDS as CONTROL_COMMANDS
from shared.protocol import WRITE_COMMANDS, ProtocolError
from shared.replica_protocol import BLOB, CANCEL, GENERATE, SLOT, STATUS
from shared.replica_protocol import COMMANDS as REPLICA_COMMANDS

log = logging.getLogger("keys")

ROLES = ("operators", "replicas")  # statesvc's control and diff sockets
INFERENCE_ROLES = ("clients", "operators", "replicas")  # a replica's listen socket
KEY_ENV, SERVER_KEY_ENV = "LORAPLANE_KEY", "LORAPLANE_SERVER_KEY"
MAX_KEY_FILE_BYTES = 64 << 10  # a certificate is ~300 bytes
CLIENT_HINT = "make a key pair with `loractl keys new NAME` and pass its NAME.key_secret"
SERVER_HINT = "pass the server.key of the key dir that `statesvc keys init DIR` made"
AUTH_DIR_HINT = ("--auth takes a key dir made by `statesvc keys init DIR` (or a copy of it, "
                 "server.key_secret included)")


# The seam between a CURVE identity and the commands it may issue: what crosses it is the
# caller's ROLE:NAME (the authenticator's User-Id, `ROLE` a key folder's name without its
# "s") and a command's name, on one of the two sockets that admit keys; what comes back is
# nothing or a `forbidden` refusal (`check_command`). Both services check here and nowhere
# else: a new command or role is one row of ROLE_COMMANDS and, if refused, one of REFUSALS.
CONTROL, INFERENCE = "control", "inference"  # statesvc's ROUTER, a replica's listen socket
ROLE_COMMANDS: dict[str, dict[str, frozenset[str]]] = {
    CONTROL: {  # ROLES
        "operator": frozenset(CONTROL_COMMANDS) - {"heartbeat"},
        "replica": frozenset(CONTROL_COMMANDS) - WRITE_COMMANDS,
    },
    INFERENCE: {  # INFERENCE_ROLES
        "operator": frozenset(REPLICA_COMMANDS),
        "client": frozenset({STATUS, GENERATE, CANCEL}),
        "replica": frozenset({BLOB, STATUS}),
    },
}
# What a refused caller is told, by its role where the role says it all, else by the command
# ({actor}: its ROLE:NAME, {cmd}: the command)
_CHANGES_LOG = "{actor} may not issue {cmd}: only operator keys may change the log"
REFUSALS: dict[str, dict[str, str]] = {
    CONTROL: {**{cmd: _CHANGES_LOG for cmd in sorted(WRITE_COMMANDS)},
              "heartbeat": "{actor} may not heartbeat: only replica keys (the key dir's "
                           "replicas/) register replicas"},
    INFERENCE: {"replica": "{actor} may not issue {cmd}: replica keys may only fetch blobs "
                           "(`blob`) and read `status`",
                BLOB: "blob hands out an adapter's weights: only replica and operator keys "
                      "may read it",
                SLOT: "slot hands out an adapter's weights: only operator keys (the key dir's "
                      "operators/) may read it"},
}


def role_of(actor: str) -> str:
    """The ROLE of a ROLE:NAME identity ("" for an identity of no role)."""
    role, colon, _ = actor.partition(":")
    return role if colon else ""


def check_command(socket: str, actor: str | None, cmd: str) -> None:
    """ProtocolError `forbidden` unless `actor` may issue `cmd` on `socket` (CONTROL or
    INFERENCE). `actor` None: no CURVE, a loopback-only socket whose every caller may issue
    everything. An identity of no role (the authenticator's "unknown") may issue nothing."""
    if actor is None:
        return
    role = role_of(actor)
    if cmd in ROLE_COMMANDS[socket].get(role, frozenset()):
        return
    refusals = REFUSALS[socket]
    why = refusals.get(role) or refusals.get(cmd) or \
        "{actor} may not issue {cmd}: its key is in none of the key dir's role folders"
    raise ProtocolError("forbidden", why.format(actor=actor, cmd=cmd))


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


def client_keys(key: str | None, server_key: str | None) -> ClientKeys | None:
    """Keys from --key/--server-key (or LORAPLANE_KEY/LORAPLANE_SERVER_KEY); None for neither."""
    key = key or os.environ.get(KEY_ENV)
    server_key = server_key or os.environ.get(SERVER_KEY_ENV)
    if not key and not server_key:
        return None
    if not (key and server_key):
        raise KeyError_("CURVE needs both --key (your *.key_secret file) and --server-key "
                        "(the server's server.key)")
    public, secret = read_key_file(Path(key), secret=True, hint=CLIENT_HINT)
    server, _ = read_key_file(Path(server_key), secret=False, hint=SERVER_HINT)
    assert secret is not None
    return ClientKeys(public, secret, server)


def server_keys(directory: Path) -> tuple[bytes, bytes]:
    """The key pair in an --auth dir's server.key_secret; KeyError_ naming the file and the fix
    (`statesvc serve` and `computed serve` check it before they open anything else)."""
    path = directory / "server.key_secret"
    if not os.path.lexists(path) and os.path.lexists(directory / "server.key"):
        raise KeyError_(f"{path} does not exist: {directory} holds server.key, the public half "
                        f"only; {AUTH_DIR_HINT}")
    public, secret = read_key_file(path, secret=True, hint=AUTH_DIR_HINT)
    assert secret is not None
    return public, secret


def auth_dir_keys(directory: Path) -> tuple[bytes, bytes]:
    """`server_keys` for a service's `--auth DIR`, or click's usage error (exit 2) naming the
    flag, the file and the fix."""
    try:
        return server_keys(directory)
    except KeyError_ as exc:
        raise click.UsageError(f"--auth {directory}: {exc}") from None


def read_key_file(path: Path, *, secret: bool, hint: str) -> tuple[bytes, bytes | None]:
    """The z85 public key of a certificate and, when `secret`, its secret key. KeyError_ naming
    the file for anything else (missing, not a regular file, huge, garbled, a key that is not
    32 bytes), ending with `hint`: what to do about it."""
    try:
        text = read_regular(path, MAX_KEY_FILE_BYTES)  # a FIFO must not block the ZAP thread
    except FileError as exc:
        raise KeyError_(f"key file {exc}; {hint}") from None
    except FileNotFoundError:
        raise KeyError_(f"key file {path} does not exist; {hint}") from None
    except OSError as exc:
        raise KeyError_(f"key file {path}: cannot open it ({exc.strerror}); {hint}") from None
    fields: dict[bytes, bytes] = {}
    for line in text.splitlines():
        name, eq, value = line.strip().partition(b"=")
        if eq:
            fields.setdefault(name.strip(), value.strip(b" \t'\""))
    found: list[bytes] = []
    for field in ("public-key", "secret-key") if secret else ("public-key",):
        key = fields.get(field.encode())
        if key is None:
            what = ("holds no secret key; pass the *.key_secret file, not the public *.key"
                    if field == "secret-key" else f'has no `{field} = "..."` line')
            raise KeyError_(f"key file {path} {what}; {hint}")
        if not _is_key(key):
            raise KeyError_(f"key file {path}: its {field} is not 40 z85 characters (a 32-byte "
                            f"CURVE key); {hint}")
        found.append(key)
    return found[0], found[1] if secret else None


def _is_key(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError):  # KeyError: a character outside z85's alphabet
        return False


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
        self.public, self.secret = server_keys(directory)
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
            log.warning("skipping %s", why)

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
    """The z85 public key of a role folder's `*.key` certificate; KeyError_ naming the file for
    anything else (a directory, a FIFO, a huge or garbled file, a key that is not 32 bytes)."""
    return read_key_file(cert, secret=False,
                         hint="copy the NAME.key that `loractl keys new NAME` wrote")[0]
