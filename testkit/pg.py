"""A real PostgreSQL server for tests: initdb + pg_ctl into a temporary directory on a free
loopback port, stopped by its postmaster's pid (tests, never a deployment).

The server keeps the durability settings of a real deployment (fsync, synchronous_commit and
full_page_writes on, the defaults): what the tests see committed is what a crash keeps.
Where the server binaries are missing, `PgServer.missing()` says which and how to install them.
As root (PostgreSQL refuses to run as root) the server runs as the `postgres` user, or `nobody`.
"""
from __future__ import annotations

import atexit
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from statesvc.tools.processes import alive, free_port

SEARCH = ("/usr/local/bin", "/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin")
INSTALL_HINT = ("install the PostgreSQL server (Debian/Ubuntu: `apt-get install "
                "postgresql`, which puts initdb and pg_ctl under /usr/lib/postgresql/N/bin), "
                "or put initdb and pg_ctl on PATH")
SUPERUSER = "loraplane"


def _binary(name: str) -> str | None:
    for d in SEARCH:
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return shutil.which(name)


class PgServer:
    """One PostgreSQL cluster in a temporary directory; `database()` makes a fresh database."""

    def __init__(self, *, host: str = "127.0.0.1", trust: str | None = None,
                 wrapper: tuple[str, ...] = ()) -> None:
        """`host`: the address it listens on; `trust`: a network (CIDR) whose clients it lets
        in without a password besides loopback's; `wrapper`: a command that execs pg_ctl (a
        network namespace's `ip netns exec NS`)."""
        self.initdb, self.pg_ctl = _binary("initdb"), _binary("pg_ctl")
        self.host, self.trust, self.wrapper = host, trust, wrapper
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="loraplane-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.pid: int | None = None
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = _unprivileged_user()
            self._as = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                        "--clear-groups"]
            os.chown(self.root, user.pw_uid, user.pw_gid)

    @staticmethod
    def missing() -> str | None:
        """Why no server can be started here, or None."""
        absent = [b for b in ("initdb", "pg_ctl", "postgres") if _binary(b) is None]
        return (f"PostgreSQL server binaries not found ({', '.join(absent)}): {INSTALL_HINT}"
                if absent else None)

    @property
    def url(self) -> str:
        return self.url_of("postgres")

    def url_of(self, database: str) -> str:
        return f"postgresql+psycopg://{SUPERUSER}@{self.host}:{self.port}/{database}"

    def _run(self, *argv: str) -> None:
        res = subprocess.run([*self.wrapper, *self._as, *argv], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({res.returncode}): "
                               f"{res.stderr[-2000:]}\n{log}")

    def start(self) -> PgServer:
        """initdb (the first time), then start the server; again after `halt`."""
        assert self.initdb and self.pg_ctl, self.missing()
        if not self.data.exists():
            self._run(self.initdb, "-D", str(self.data), "-U", SUPERUSER, "--auth=trust",
                      "--encoding=UTF8", "--locale=C", "--no-instructions")
            if self.trust is not None:
                with open(self.data / "pg_hba.conf", "a") as hba:
                    hba.write(f"host all all {self.trust} trust\n")
            atexit.register(self.stop)  # a session that dies leaves no server behind
        self._run(self.pg_ctl, "start", "-w", "-t", "60", "-D", str(self.data), "-l",
                  str(self.log), "-o", f"-p {self.port} -k {self.root} "
                  f"-c listen_addresses={self.host} -c max_connections=200")
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])
        return self

    def database(self) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:16]
        with psycopg.connect(self.url.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url_of(name)

    def reset(self, url: str) -> str:
        """Empty the database at `url` (its public schema dropped and made again), cheaper
        than a new database (each is a copy of template1 through the WAL); returns `url`."""
        import psycopg

        with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute("DROP SCHEMA public CASCADE")
            conn.execute("CREATE SCHEMA public")
        return url

    def stop(self) -> None:
        """Stop the server in immediate mode (the cluster is thrown away); remove it."""
        self.halt()
        shutil.rmtree(self.root, ignore_errors=True)

    def halt(self, *, mode: signal.Signals = signal.SIGQUIT) -> None:
        """Stop the postmaster by its pid (SIGQUIT: immediate, as a crash leaves the data;
        SIGINT: fast shutdown), then SIGKILL after 30 s; the data stay for `start`."""
        if self.pid is not None:
            pid, self.pid = self.pid, None
            try:
                os.kill(pid, mode)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 30
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _unprivileged_user() -> pwd.struct_passwd:
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root, and neither a `postgres` nor a `nobody` user exists "
                       "to run PostgreSQL as (it refuses root); create one")
