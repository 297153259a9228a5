"""loractl's reads: `list` (the registry, page by page), `events` (the log, or following it)
and `status` (the log's head and every replica's state)."""
from __future__ import annotations

import sys
import time
from typing import Any

import click
import zmq

from shared.client import ControlClient, RemoteError, Unavailable, list_adapters
from shared.config import DEFAULT_PUBLISH, MAX_SEQ
from shared.endpoints import click_address, connect
from statesvc.console import JSON_OPT, emit, err, handles_errors, out, terminal_safe
from statesvc.loractl.client import client
from statesvc.loractl.options import TEXT
from statesvc.loractl.tables import EVENT_KEYS, adapters_table, print_events, replicas_table


@click.command("list")
@click.option("--limit", type=click.IntRange(1), default=None,
              help="At most this many adapters (default: all, fetched page by page).")
@click.option("--after", type=TEXT, default=None, metavar="NAME",
              help="Only adapters whose names sort after NAME: the next page.")
@JSON_OPT
@click.pass_context
@handles_errors
def list_(ctx: click.Context, limit: int | None, after: str | None, as_json: bool) -> None:
    """The registered adapters, by name."""
    with client(ctx) as c:
        res, adapters = list_adapters(c, after=after, limit=limit)
    if as_json:
        emit(adapters)
        return
    if res["pool"] is None:
        out.print("the pool is not configured yet (loractl pool init ...)")
        return
    out.print(adapters_table(res, adapters))
    if limit is not None and adapters and len(adapters) == limit:
        out.print(terminal_safe(f"next page: loractl list --limit {limit} "
                                f"--after {adapters[-1]['name']}"))


def _fetch_events(c: ControlClient, since: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while True:
        page = c.call("events", {"since": since})["events"]
        if not page:
            return events
        events += page
        since = page[-1]["seq"]


@click.command()
@click.option("--since", type=click.IntRange(0, MAX_SEQ), default=0,
              help="Only events after this seq.")
@click.option("--follow", is_flag=True, help="Keep printing new events as they are recorded.")
@click.option("--diffs", envvar="LORAPLANE_DIFFS", default=DEFAULT_PUBLISH, show_default=True,
              callback=click_address, help="Diff address to follow (env LORAPLANE_DIFFS).")
@JSON_OPT
@click.pass_context
@handles_errors
def events(ctx: click.Context, since: int, follow: bool, diffs: str, as_json: bool) -> None:
    """The event log. With --json: an array, or one JSON object per line with --follow."""
    if not follow:
        with client(ctx) as c:
            evs = _fetch_events(c, since)
        if as_json:
            emit([{k: e[k] for k in EVENT_KEYS} for e in evs])
        else:
            print_events(evs)
        return
    with client(ctx) as c:
        sub: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        connect(sub, diffs)
        try:
            _follow(c, sub, since, as_json)
        except KeyboardInterrupt:
            pass
        finally:
            sub.close(0)


FOLLOW_WAITS_S = (0.5, 5.0)  # while statesvc cannot answer: the first wait, the longest


def _follow(c: ControlClient, sub: zmq.Socket[Any], since: int, as_json: bool) -> None:
    """Print each event after `since` as it is recorded, page by page, each seq once and in
    order. While statesvc cannot answer (its database away: `storage_error`; silent:
    Unavailable) it asks again, waiting longer each time, from the last seq printed: one
    line on stderr when that starts and one when it ends."""
    wait = 0.0  # > 0 while statesvc cannot answer
    while True:
        try:
            page = c.call("events", {"since": since})["events"]
        except (RemoteError, Unavailable) as exc:
            if isinstance(exc, RemoteError) and exc.code != "storage_error":
                raise
            if not wait:
                why = f"storage_error: {exc}" if isinstance(exc, RemoteError) else str(exc)
                err.print("[dim]" + terminal_safe(f"events --follow: {why}; asking again "
                                                  f"until it answers (after seq {since})")
                          + "[/]")
            wait = min(wait * 2 or FOLLOW_WAITS_S[0], FOLLOW_WAITS_S[1])
            time.sleep(wait)
            continue
        if wait:
            err.print("[dim]" + terminal_safe(f"events --follow: statesvc answers again; "
                                              f"following on after seq {since}") + "[/]")
            wait = 0.0
        for e in page:
            if as_json:
                emit({k: e[k] for k in EVENT_KEYS})
            else:
                print_events([e])
            since = e["seq"]
        sys.stdout.flush()
        if not page and sub.poll(1000):  # caught up: until a diff is published, or a second
            while sub.poll(0):
                sub.recv_multipart()


@click.command()
@JSON_OPT
@click.pass_context
@handles_errors
def status(ctx: click.Context, as_json: bool) -> None:
    """The log's head and digest, and every replica's state."""
    with client(ctx) as c:
        res = c.call("status")
    if as_json:
        emit(res)
        return
    out.print(terminal_safe(f"head seq {res['head_seq']}, logical digest {res['digest'][:16]}, "
                            f"log {res['log_id'] or 'none yet (no pool init)'}"))
    if not res["replicas"]:
        out.print("no replicas have reported")
        return
    out.print(replicas_table(res["replicas"]))
