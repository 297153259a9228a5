"""How loractl reaches statesvc: the control client the global options describe, and a write
resent under its one event id while statesvc answers `storage_error`."""
from __future__ import annotations

import shlex
import sys
import time
from typing import Any

import click

from shared.client import ControlClient, RemoteError, Unavailable, new_event_id
from statesvc.console import err, keys_of, terminal_safe

WRITE_RETRY_WAITS_S = (0.5, 1.0, 2.0)  # a write answered storage_error is resent after each


def client(ctx: click.Context) -> ControlClient:
    """A client of the statesvc instances in --state, with --timeout and the CURVE keys."""
    return ControlClient(ctx.obj["state"], timeout_s=ctx.obj["timeout"],
                         keys=keys_of(ctx.obj["key"], ctx.obj["server_key"]))


def write(ctx: click.Context, cmd: str, args: dict[str, Any]) -> Any:
    """Send a write under its event id (--event-id, or a fresh one), resending it with the same
    id when statesvc answers `storage_error`, up to len(WRITE_RETRY_WAITS_S) times. An error it
    gives up on names the event id and the command that retries it."""
    event_id = args["event_id"] = args["event_id"] or new_event_id()
    with client(ctx) as c:
        for wait in (*WRITE_RETRY_WAITS_S, None):
            try:
                return c.call(cmd, args)
            except RemoteError as exc:
                if exc.code != "storage_error":
                    raise
                if wait is None:
                    raise RemoteError(exc.code, f"{exc}; loractl resent it "
                                      f"{len(WRITE_RETRY_WAITS_S)} times. Once the cause is "
                                      f"fixed, retry with: {retry_command(event_id)}",
                                      exc.field) from None
                why = f"storage_error ({exc})" if wait == WRITE_RETRY_WAITS_S[0] else "again"
                err.print("[dim]" + terminal_safe(f"{cmd}: {why}; resending in {wait:g} s "
                                                  f"with the same event id {event_id}") + "[/]")
                time.sleep(wait)
            except Unavailable as exc:
                raise Unavailable(f"{exc}. The {cmd} may or may not have been recorded; to "
                                  f"retry it (recorded at most once): "
                                  f"{retry_command(event_id)}") from None
    raise AssertionError("unreachable")


def retry_command(event_id: str) -> str:
    """This command line again, under `event_id`."""
    argv = sys.argv[1:]
    has_id = any(a == "--event-id" or a.startswith("--event-id=") for a in argv)
    return shlex.join(["loractl", *argv, *([] if has_id else ["--event-id", event_id])])
