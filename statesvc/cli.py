"""`statesvc serve` and `statesvc migrate`."""
from __future__ import annotations

import fcntl
import logging
import os
import sys
from pathlib import Path
from typing import IO

import click
from sqlalchemy import make_url
from sqlalchemy.exc import DatabaseError

from shared.config import (DEFAULT_CONTROL, DEFAULT_DATA_DIR, DEFAULT_PUBLISH,
                           DEFAULT_SNAPSHOT_EVERY, HEARTBEAT_INTERVAL_S, MAX_ADAPTER_BYTES,
                           MAX_REPLICAS, MAX_REPLICAS_CEILING)
from shared.endpoints import BindError, Endpoint, EndpointError, check_bind
from statesvc.persistence import StoreError, open_log, open_store, recovery_steps, sqlite_url

DATA_DIR = click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
                        default=DEFAULT_DATA_DIR, show_default=True,
                        help="Where the SQLite file and the blob store live (unused with "
                        "a PostgreSQL --db).")
DB_URL = click.option("--db", "db_url", default=None,
                      help="SQLAlchemy URL of the event store [default: sqlite:///DATA_DIR/state.db]; "
                      "postgresql+psycopg://USER@HOST/DB for a log several instances share "
                      "(docs/postgres.md).")


def _make_data_dir(data_dir: Path) -> None:
    """Create the data dir, or a usage error saying why it cannot be."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.UsageError(_unusable(data_dir, exc)) from None


def _unusable(data_dir: Path, exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(data_dir) else ""
    return (f"--data-dir {data_dir}: {exc.strerror or exc}{where}; choose a directory this "
            "user can create and write")


def _lock_data_dir(data_dir: Path) -> IO[str]:
    """Hold an exclusive lock on the data dir: the log has a single writer."""
    _make_data_dir(data_dir)
    try:
        lock = (data_dir / "statesvc.lock").open("a+")
    except OSError as exc:
        raise click.UsageError(_unusable(data_dir, exc)) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise click.ClickException(f"another statesvc is already serving {data_dir} (it holds "
                                   f"{data_dir / 'statesvc.lock'}); stop it first") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


@click.group()
def main() -> None:
    """loraplane state service: the durable adapter event log."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="statesvc %(levelname)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)


@main.group()
def keys() -> None:
    """CurveZMQ keys."""


@keys.command("init")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def keys_init(directory: Path) -> None:
    """Write the server key pair into DIRECTORY, with operators/ and replicas/ folders for
    the public keys of the clients allowed in each role."""
    from shared.keys import KeyError_, init_server_keys

    try:
        public, secret = init_server_keys(directory)
    except KeyError_ as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"server public key {public} (give it to clients as --server-key)\n"
               f"server secret key {secret} (keep it here)\n"
               f"allow an operator: copy its NAME.key into {directory / 'operators'}\n"
               f"allow a replica:   copy its NAME.key into {directory / 'replicas'}")


@main.command()
@DATA_DIR
@DB_URL
def migrate(data_dir: Path, db_url: str | None) -> None:
    """Upgrade the event store's schema to head, then exit."""
    _make_data_dir(data_dir)
    try:  # the store's own checks first: a damaged log, or one that lost events, stays as it is
        open_store(db_url or sqlite_url(data_dir)).close()
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("schema is at head")


@main.command()
@DATA_DIR
@DB_URL
@click.option("--control", default=DEFAULT_CONTROL, show_default=True,
              help="ZeroMQ address of the control (ROUTER) socket.")
@click.option("--publish", default=DEFAULT_PUBLISH, show_default=True,
              help="ZeroMQ address of the diff (PUB) socket.")
@click.option("--snapshot-every", type=click.IntRange(0), default=DEFAULT_SNAPSHOT_EVERY,
              show_default=True, help="Write a snapshot every N events (0: never).")
@click.option("--heartbeat-interval", type=click.FloatRange(0.05), default=HEARTBEAT_INTERVAL_S,
              show_default=True, help="Seconds between heartbeats on the diff socket.")
@click.option("--max-adapter-bytes", type=click.IntRange(1), default=MAX_ADAPTER_BYTES,
              show_default=True, help="Largest adapter_model.safetensors accepted by load.")
@click.option("--auth", "auth_dir", type=click.Path(exists=True, file_okay=False,
                                                    path_type=Path), default=None,
              help="CURVE: the key dir made by `statesvc keys init`; only keys in its "
                   "operators/ and replicas/ folders may connect.")
@click.option("--adapter-root", "adapter_roots", multiple=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Only load adapters from under this directory (repeatable).")
@click.option("--max-replicas", type=click.IntRange(1, MAX_REPLICAS_CEILING),
              default=MAX_REPLICAS, show_default=True, help="Replica ids kept in the registry (at most "
              f"{MAX_REPLICAS_CEILING}: `status` must fit one reply).")
def serve(data_dir: Path, db_url: str | None, control: str, publish: str, snapshot_every: int,
          heartbeat_interval: float, max_adapter_bytes: int, auth_dir: Path | None,
          adapter_roots: tuple[Path, ...], max_replicas: int) -> None:
    """Upgrade the schema, then serve commands and publish diffs until SIGTERM or Ctrl-C."""
    from shared import memtune, runfile
    from statesvc.server import Server
    from statesvc.service import StateService

    endpoints: dict[str, Endpoint] = {}
    for flag, address in (("--control", control), ("--publish", publish)):
        try:
            endpoints[flag] = check_bind(address, authenticated=auth_dir is not None)
        except EndpointError as exc:
            raise click.UsageError(f"{flag}: {exc}") from None
    if endpoints["--control"] == endpoints["--publish"] and endpoints["--control"].port != 0:
        raise click.UsageError(f"--control and --publish are both {control}; give each socket "
                               "an address of its own")
    if auth_dir is not None:  # before the data dir is created or the schema touched
        from shared.keys import auth_dir_keys
        auth_dir_keys(auth_dir)
    memtune.tune()  # a blob's buffers reuse their pages (shared/memtune.py)
    url = db_url or sqlite_url(data_dir)
    # SQLite: one writer per data dir; PostgreSQL: any number, serialised by the database
    lock = None if make_url(url).get_backend_name() == "postgresql" else _lock_data_dir(data_dir)
    try:
        store, blobs = open_log(url, blobs_dir=data_dir / "blobs")
    except StoreError as exc:  # damaged, or behind its high-water mark: nothing was changed
        raise click.ClickException(str(exc)) from None
    try:
        service = StateService(store, blobs,
                               snapshot_every=snapshot_every, max_adapter_bytes=max_adapter_bytes,
                               adapter_roots=tuple(r.resolve() for r in adapter_roots),
                               max_replicas=max_replicas)
    except DatabaseError as exc:  # a page of the log could not be read
        store.close()
        raise click.ClickException(f"the event store {db_url or sqlite_url(data_dir)} is damaged "
                                   f"({exc.orig}); statesvc changed nothing. "
                                   + recovery_steps(data_dir.resolve())) from None
    try:
        server = Server(service, control=control, publish=publish,
                        heartbeat_interval=heartbeat_interval, auth_dir=auth_dir)
    except BindError as exc:  # in use, or not this host's: nothing was served
        store.close()
        flag = next((f for f, e in endpoints.items() if e == exc.endpoint), "--control")
        raise click.UsageError(f"{flag} {exc}") from None
    log = logging.getLogger("statesvc")
    log.info("store %s, head seq %d, log %s", _shown(url), service.state.seq,
             service.log_id or "(none until pool init)")
    if auth_dir is None:
        log.warning("control %s, diffs %s: NO AUTHENTICATION, loopback only; anyone on this "
                    "host may issue commands (pass --auth DIR to require keys)",
                    server.control, server.publish)
    else:
        log.info("control %s, diffs %s: CURVE, keys allowed in %s", server.control,
                 server.publish, auth_dir)
    if not adapter_roots:
        log.warning("no --adapter-root: load accepts adapter directories anywhere on this host")
    # what `loractl drill --kill-statesvc DATA_DIR` trusts to kill and restart this instance
    runfile.write(data_dir / runfile.RUN_FILE, runfile.RunFile(
        runfile.STATESVC_RUN_ID, os.getpid(), runfile.own_cmdline(), os.getcwd(), server.control, ""))
    print(f"READY control={server.control} publish={server.publish}", flush=True)
    try:
        server.serve_forever()
    finally:
        store.close()
        if lock is not None:
            lock.close()
    log.info("stopped")


def _shown(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)
