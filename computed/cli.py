"""`computed serve`: a replica of the adapter pool, kept in step with statesvc."""
from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import click

from shared.config import DEFAULT_CONTROL, DEFAULT_PUBLISH, DEFAULT_REPLICA_LISTEN


@click.group()
def main() -> None:
    """loraplane compute daemon: a JAX LoRA memory pool that follows the log."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="computed %(levelname)s %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


@main.command()
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False,
                                                        path_type=Path),
              help="Hugging Face checkpoint directory of the pool's base model.")
@click.option("--state", default=DEFAULT_CONTROL, show_default=True,
              help="statesvc's control address.")
@click.option("--diffs", default=DEFAULT_PUBLISH, show_default=True,
              help="statesvc's diff (PUB) address.")
@click.option("--listen", default=DEFAULT_REPLICA_LISTEN, show_default=True,
              help="This replica's ROUTER address (status; inference).")
@click.option("--replica-id", default=None, help="[default: HOST-PORT of --listen]")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Blob cache and local state [default: ./var/replicas/ID].")
def serve(model: Path, state: str, diffs: str, listen: str, replica_id: str | None,
          cache_dir: Path | None) -> None:
    """Follow the log and hold every loaded adapter in the pool, until SIGTERM or Ctrl-C."""
    from computed.daemon import Daemon
    from computed.replica import ModelMismatch, Replica
    from shared.client import ControlClient
    from shared.fingerprint import ModelError, read_model

    log = logging.getLogger("computed")
    try:
        info = read_model(model)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from None
    replica_id = replica_id or f"{socket.gethostname()}-{listen.rsplit(':', 1)[-1]}"
    cache_dir = cache_dir or Path("var") / "replicas" / replica_id
    # the client's socket is made on first use, in the sync thread that alone uses it
    client = ControlClient(state, timeout_s=3.0, retries=1)
    daemon = Daemon(Replica(info, client, cache_dir), replica_id=replica_id, listen=listen,
                    state=state, diffs=diffs)
    log.info("replica %s: model %s (%s), statesvc %s / %s, cache %s", replica_id, model,
             info.fingerprint[:12], state, diffs, cache_dir)
    print(f"READY listen={daemon.listen} id={replica_id}", flush=True)
    try:
        daemon.serve_forever()
    except ModelMismatch as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    finally:
        client.close()
    log.info("stopped")
