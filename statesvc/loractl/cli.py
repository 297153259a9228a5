"""The `loractl` command group: the global options every command reads (--state, --timeout,
the CURVE keys), `keys new`, and every command added from the module that holds it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from shared.client import Unsendable
from shared.config import DEFAULT_CONTROL, STATE_ENV
from shared.endpoints import click_addresses
from statesvc.console import out
from statesvc.loractl.generate import generate
from statesvc.loractl.options import MAX_TIMEOUT_S, Finite
from statesvc.loractl.reads import events, list_, status
from statesvc.loractl.writes import load, pool, unload
from statesvc.tools.commands import drill, make_example_cmd


class Loractl(click.Group):
    """The command group; an argument the wire cannot carry is a usage error (exit 2)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Unsendable as exc:
            raise click.UsageError(str(exc), ctx) from None


@click.group(cls=Loractl)
@click.option("--state", envvar=STATE_ENV, default=DEFAULT_CONTROL, show_default=True,
              callback=click_addresses,
              help=f"Control address of the state service (env {STATE_ENV}); several "
                   "instances of one log as a,b: a silent one is left for the next.")
@click.option("--timeout", type=Finite(0.1, MAX_TIMEOUT_S), default=10.0, show_default=True,
              help="Seconds to wait for each answer before retrying.")
@click.option("--key", envvar="LORAPLANE_KEY", default=None,
              help="CURVE: your secret key file, NAME.key_secret (env LORAPLANE_KEY).")
@click.option("--server-key", envvar="LORAPLANE_SERVER_KEY", default=None,
              help="CURVE: the server's public key file (env LORAPLANE_SERVER_KEY).")
@click.pass_context
def main(ctx: click.Context, state: str, timeout: float, key: str | None,
         server_key: str | None) -> None:
    """Manage the LoRA adapters served by a loraplane fleet."""
    ctx.obj = {"state": state, "timeout": timeout, "key": key, "server_key": server_key}


@main.group("keys")
def keys_group() -> None:
    """CurveZMQ client keys."""


@keys_group.command("new")
@click.argument("name")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              default=Path("."), show_default=True, help="Where to write the key pair.")
def keys_new(name: str, directory: Path) -> None:
    """Write a client key pair NAME.key (public: give it to the server's admin) and
    NAME.key_secret (keep it: pass it as --key)."""
    from shared.keys import new_client_keys

    public, secret = new_client_keys(directory, name)
    out.print(f"public key {public}: copy it into the server key dir's operators/ (or "
              f"replicas/)\nsecret key {secret}: use it as --key (env LORAPLANE_KEY)")


for command in (pool, load, unload, list_, events, status, generate, drill, make_example_cmd):
    main.add_command(command)
