"""loractl: the operators' CLI for the state service.

Every command takes --json for scripts; without it, readable tables. Errors go
to stderr: exit 1 when the service refused the command, 3 when it did not
answer (2 is a usage error, as click reports it). Everything a service or a
replica sent is printed through `terminal_safe` (statesvc/console.py): no terminal
control sequence and no rich markup from the wire reaches the terminal.
"""
from __future__ import annotations

import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import click
import zmq
from rich.table import Table

from shared.client import (ControlClient, RemoteError, Unavailable, Unsendable, list_adapters,
                           new_event_id)
from shared.config import (DEFAULT_CONTROL, DEFAULT_MAX_ADAPTERS, DEFAULT_PUBLISH, MAX_MAX_ADAPTERS,
                           MAX_SEED, MAX_SEQ, POOL_DTYPES, STATE_ENV, UUID_RE)
from shared.endpoints import click_address, click_addresses, connect
from shared.errors import short_int
from shared.llama import MODULES
from shared.replica_protocol import GENERATE, GENERATE_DEFAULTS, generate_args
from statesvc.console import JSON_OPT, emit, err, handles_errors, keys_of, out, terminal_safe
from statesvc.tools.commands import drill, make_example_cmd

# the ranges the services take (shared/protocol.py, shared/replica_protocol.py), so a value
# beyond them is a usage error naming the option, never a frame that cannot be encoded
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 on a replica
MAX_TIMEOUT_S = 86400.0


class Finite(click.FloatRange):
    """click's FloatRange without nan, which compares false with either bound."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if math.isnan(rv):
            self.fail(f"{value!r} is not a number", param, ctx)
        return rv


def _utf8(value: str) -> bool:
    """Whether `value` can go on the wire, where text is UTF-8 (bytes from the shell that do
    not decode reach Python as surrogates, which cannot be encoded)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


class Text(click.types.StringParamType):
    """A string that the wire can carry: valid UTF-8."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        text = super().convert(value, param, ctx)
        if not _utf8(text):
            self.fail(f"{text!r} is not valid UTF-8 text; the services take UTF-8 only",
                      param, ctx)
        return text


TEXT = Text()


def _wire_path(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A directory whose absolute path goes on the wire: valid UTF-8."""
    if value is not None and not _utf8(str(value.resolve())):
        raise click.BadParameter(f"{str(value)!r} is not valid UTF-8 text, and the state "
                                 "service takes paths as UTF-8; rename the directory, or link "
                                 "it from a path that is")
    return value


class EventId(click.types.StringParamType):
    """A write's event id as the protocol takes it: a lowercase UUID."""

    name = "uuid"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        if not isinstance(value, str) or not UUID_RE.fullmatch(value):
            self.fail(f"{value!r} is not a lowercase UUID such as "
                      "'0b7e4f9e-3c1a-4f7e-9a52-1f0c2d3e4b5a'", param, ctx)
        return value


EVENT_ID = click.option("--event-id", type=EventId(), default=None, metavar="UUID",
                        help="The write's event id [default: a fresh one]. Give the one an "
                        "earlier try printed to retry that write: it is recorded at most once.")
WRITE_RETRY_WAITS_S = (0.5, 1.0, 2.0)  # a write answered storage_error is resent after each


def _write(ctx: click.Context, cmd: str, args: dict[str, Any]) -> Any:
    """Send a write under its event id (--event-id, or a fresh one), resending it with the same
    id when statesvc answers `storage_error`, up to len(WRITE_RETRY_WAITS_S) times. An error it
    gives up on names the event id and the command that retries it."""
    event_id = args["event_id"] = args["event_id"] or new_event_id()
    with _client(ctx) as c:
        for wait in (*WRITE_RETRY_WAITS_S, None):
            try:
                return c.call(cmd, args)
            except RemoteError as exc:
                if exc.code != "storage_error":
                    raise
                if wait is None:
                    raise RemoteError(exc.code, f"{exc}; loractl resent it "
                                      f"{len(WRITE_RETRY_WAITS_S)} times. Once the cause is "
                                      f"fixed, retry with: {_retry_command(event_id)}",
                                      exc.field) from None
                why = f"storage_error ({exc})" if wait == WRITE_RETRY_WAITS_S[0] else "again"
                err.print("[dim]" + terminal_safe(f"{cmd}: {why}; resending in {wait:g} s with the "
                                          f"same event id {event_id}") + "[/]")
                time.sleep(wait)
            except Unavailable as exc:
                raise Unavailable(f"{exc}. The {cmd} may or may not have been recorded; to "
                                  f"retry it (recorded at most once): "
                                  f"{_retry_command(event_id)}") from None
    raise AssertionError("unreachable")


def _retry_command(event_id: str) -> str:
    """This command line again, under `event_id`."""
    argv = sys.argv[1:]
    has_id = any(a == "--event-id" or a.startswith("--event-id=") for a in argv)
    return shlex.join(["loractl", *argv, *([] if has_id else ["--event-id", event_id])])


EXPECT_HEAD = click.option("--expect-head", type=click.IntRange(0, MAX_SEQ), default=None,
                           help="Refuse (conflict) unless the log's head is at this seq.")


def _short(targets: list[str]) -> str:
    """q_proj,v_proj -> q,v: what a table cell has room for."""
    return ",".join(t.removesuffix("_proj") for t in targets)


def _client(ctx: click.Context) -> ControlClient:
    return ControlClient(ctx.obj["state"], timeout_s=ctx.obj["timeout"],
                         keys=keys_of(ctx.obj["key"], ctx.obj["server_key"]))


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


@main.group()
def pool() -> None:
    """The memory pool's immutable settings."""


def _parse_targets(value: str) -> str | list[str]:
    if value == "all":
        return "all"
    targets = [t.strip() for t in value.split(",") if t.strip()]
    unknown = [t for t in targets if t not in MODULES]
    if unknown or not targets:
        raise click.BadParameter(f"unknown module(s) {unknown}; use 'all' or a comma-separated "
                                 f"list of {', '.join(MODULES)}")
    return targets


@pool.command("init")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False,
                                                        path_type=Path), callback=_wire_path,
              help="Hugging Face checkpoint directory of the base model.")
@click.option("--max-loras", required=True, type=click.IntRange(1, 4096),
              help="Device slots per replica: the most distinct adapters one batch holds.")
@click.option("--max-adapters", type=click.IntRange(1, MAX_MAX_ADAPTERS),
              default=DEFAULT_MAX_ADAPTERS, show_default=True,
              help="Most adapters the registry holds (resident in a slot or not).")
@click.option("--max-rank", required=True, type=click.IntRange(1, 1024),
              help="Largest LoRA rank the pool takes.")
@click.option("--targets", required=True, help="'all' or a comma list, e.g. q_proj,v_proj.")
@click.option("--dtype", type=click.Choice(POOL_DTYPES), default="float32", show_default=True)
@EXPECT_HEAD
@EVENT_ID
@JSON_OPT
@click.pass_context
@handles_errors
def pool_init(ctx: click.Context, model: Path, max_loras: int, max_adapters: int,
              max_rank: int, targets: str, dtype: str, expect_head: int | None,
              event_id: str | None, as_json: bool) -> None:
    """Configure the pool (the log's genesis event). Its settings never change."""
    res = _write(ctx, "pool.init", {"event_id": event_id, "model": str(model.resolve()),
                                    "max_loras": max_loras, "max_adapters": max_adapters,
                                    "max_rank": max_rank, "targets": _parse_targets(targets),
                                    "dtype": dtype, "expect_head": expect_head})
    if as_json:
        emit(res)
    else:
        verb = "configured" if res["created"] else "already configured with these settings"
        out.print(terminal_safe(f"pool {verb} at seq {res['seq']}: {res['max_loras']} slots per replica, "
                        f"up to {res['max_adapters']} adapters, max rank "
                        f"{res['max_rank']}, targets {','.join(res['targets'])}, "
                        f"{res['dtype']}, model {res['fingerprint'][:12]}"))


@main.command()
@click.argument("name", type=TEXT)
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path),
                callback=_wire_path)
@click.option("--pin", is_flag=True, help="Keep it resident on every replica, never evicted "
              "(at most max_loras - 1 pinned); unload then needs --force.")
@click.option("--replace", is_flag=True, help="Record a new version if NAME holds other content.")
@EXPECT_HEAD
@EVENT_ID
@JSON_OPT
@click.pass_context
@handles_errors
def load(ctx: click.Context, name: str, path: Path, pin: bool, replace: bool,
         expect_head: int | None, event_id: str | None, as_json: bool) -> None:
    """Load the PEFT adapter in PATH as NAME."""
    res = _write(ctx, "load", {"event_id": event_id, "name": name, "path": str(path.resolve()),
                               "pin": pin, "replace": replace, "expect_head": expect_head})
    if as_json:
        emit({k: res[k] for k in ("seq", "name", "version")})
    elif res["created"]:
        out.print(terminal_safe(f"loaded {res['name']} version {res['version']} (seq {res['seq']})"))
    else:
        out.print(terminal_safe(f"{res['name']} is already loaded with this content: version "
                        f"{res['version']}; nothing recorded"))


@main.command()
@click.argument("name", type=TEXT)
@click.option("--force", is_flag=True, help="Unload even if the adapter is pinned.")
@EXPECT_HEAD
@EVENT_ID
@JSON_OPT
@click.pass_context
@handles_errors
def unload(ctx: click.Context, name: str, force: bool, expect_head: int | None,
           event_id: str | None, as_json: bool) -> None:
    """Unload the adapter NAME."""
    res = _write(ctx, "unload", {"event_id": event_id, "name": name, "force": force,
                                 "expect_head": expect_head})
    if as_json:
        emit(res)
    else:
        out.print(terminal_safe(f"unloaded {res['name']} version {res['version']} (seq {res['seq']})"))


@main.command("list")
@click.option("--limit", type=click.IntRange(1), default=None,
              help="At most this many adapters (default: all, fetched page by page).")
@click.option("--after", type=TEXT, default=None, metavar="NAME",
              help="Only adapters whose names sort after NAME: the next page.")
@JSON_OPT
@click.pass_context
@handles_errors
def list_(ctx: click.Context, limit: int | None, after: str | None, as_json: bool) -> None:
    """The registered adapters, by name."""
    with _client(ctx) as c:
        res, adapters = list_adapters(c, after=after, limit=limit)
    if as_json:
        emit(adapters)
        return
    pool_ = res["pool"]
    if pool_ is None:
        out.print("the pool is not configured yet (loractl pool init ...)")
        return
    shown_ = "" if len(adapters) == res["count"] else f"{len(adapters)} shown, "
    table = Table(title=terminal_safe(f"{shown_}{res['count']} of {pool_['max_adapters']} adapters "
                              f"registered ({pool_['max_loras']} slots per replica), "
                              f"head seq {res['head_seq']}"))
    for col in ("name", "version", "rank", "alpha", "scaling", "targets", "sha256", "pinned"):
        table.add_column(col, justify="right" if col in ("version", "rank") else "left")
    for a in adapters:
        table.add_row(*map(shown, (a["name"], a["version"], a["rank"],
                                   f"{a['alpha']:g}", f"{a['scaling']:.4g}")),
                      terminal_safe(_short(a["targets"])), terminal_safe(a["sha256"][:12]),
                      "yes" if a["pinned"] else "")
    out.print(table)
    if limit is not None and adapters and len(adapters) == limit:
        out.print(terminal_safe(f"next page: loractl list --limit {limit} --after {adapters[-1]['name']}"))


EVENT_KEYS = ("seq", "event_id", "type", "payload", "recorded_at", "actor")


def _event_summary(ev: dict[str, Any]) -> str:
    p = ev["payload"]
    if ev["type"] == "pool.configured":
        return (f"{p['max_loras']} slots, max rank {p['max_rank']}, "
                f"{_short(p['targets'])}, {p['dtype']}")
    if ev["type"] == "adapter.loaded":
        rep = f", replaces v{p['replaces']['version']}" if p.get("replaces") else ""
        return f"{p['name']} v{p['version']} (r={p['rank']}{rep})"
    return f"{p['name']} v{p['version']}"


def _fetch_events(c: ControlClient, since: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while True:
        page = c.call("events", {"since": since})["events"]
        if not page:
            return events
        events += page
        since = page[-1]["seq"]


@main.command()
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
        with _client(ctx) as c:
            evs = _fetch_events(c, since)
        if as_json:
            emit([{k: e[k] for k in EVENT_KEYS} for e in evs])
        else:
            _print_events(evs)
        return
    with _client(ctx) as c:
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
                err.print("[dim]" + terminal_safe(f"events --follow: {why}; asking again until it "
                                          f"answers (after seq {since})") + "[/]")
            wait = min(wait * 2 or FOLLOW_WAITS_S[0], FOLLOW_WAITS_S[1])
            time.sleep(wait)
            continue
        if wait:
            err.print("[dim]" + terminal_safe(f"events --follow: statesvc answers again; following "
                                      f"on after seq {since}") + "[/]")
            wait = 0.0
        for e in page:
            if as_json:
                emit({k: e[k] for k in EVENT_KEYS})
            else:
                _print_events([e])
            since = e["seq"]
        sys.stdout.flush()
        if not page and sub.poll(1000):  # caught up: until a diff is published, or a second
            while sub.poll(0):
                sub.recv_multipart()


def _print_events(evs: list[dict[str, Any]]) -> None:
    table = Table()
    for col in ("seq", "recorded_at", "type", "what", "actor", "event_id"):
        table.add_column(col)
    for e in evs:
        table.add_row(*map(shown, (e["seq"], e["recorded_at"][:23], e["type"],
                                   _event_summary(e), e["actor"], e["event_id"][:8])))
    out.print(table)


AGREES = {True: "[green]yes[/]", False: "[bold red]NO[/]",
          None: "[yellow]behind[/]"}  # None: at a seq older than statesvc's recent heads


@main.command()
@JSON_OPT
@click.pass_context
@handles_errors
def status(ctx: click.Context, as_json: bool) -> None:
    """The log's head and digest, and every replica's state."""
    with _client(ctx) as c:
        res = c.call("status")
    if as_json:
        emit(res)
        return
    out.print(terminal_safe(f"head seq {res['head_seq']}, logical digest {res['digest'][:16]}, "
                    f"log {res['log_id'] or 'none yet (no pool init)'}"))
    if not res["replicas"]:
        out.print("no replicas have reported")
        return
    table = Table()
    for col in ("replica", "address", "state", "applied", "logical", "pool", "agrees"):
        table.add_column(col)
    for r in res["replicas"]:
        address = r["address"] + (f" (was {r['previous_address']})"
                                   if r.get("previous_address") else "")
        table.add_row(*map(shown, (r["id"], address, r["state"], r["applied_seq"],
                                   r["logical_digest"][:12], r["pool_digest"][:12])),
                      AGREES[r["agrees"]])
    out.print(table)


def _parse_ids(value: str, option: str) -> list[int]:
    try:
        ids = [int(t) for t in value.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated token ids, e.g. 1,2,3",
                                 param_hint=option) from None
    if not ids:
        raise click.BadParameter("at least one token id is needed", param_hint=option)
    beyond = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if beyond is not None:
        raise click.BadParameter(f"token ids are 0 to {MAX_TOKEN_ID} (the model's vocabulary "
                                 f"bounds them further), got {short_int(beyond)}",
                                 param_hint=option)
    return ids


@main.command()
@click.option("--replica", required=True, envvar="LORAPLANE_REPLICA", callback=click_address,
              help="A replica's listen address, e.g. tcp://127.0.0.1:7200 (env LORAPLANE_REPLICA).")
@click.option("--adapter", type=TEXT, default=None,
              help="Adapter name; without it, the base model.")
@click.option("--input-ids", default=None, help="Prompt token ids, comma-separated.")
@click.option("--prompt", type=TEXT, default=None,
              help="Prompt text instead of --input-ids, tokenized with --model's tokenizer; "
                   "the output is shown as text too.")
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="The base model dir whose tokenizer.json --prompt uses.")
@click.option("--max-new-tokens", type=click.IntRange(1, MAX_SEQ),
              default=GENERATE_DEFAULTS["max_new_tokens"], show_default=True)
@click.option("--temperature", type=Finite(0, 100), default=GENERATE_DEFAULTS["temperature"],
              show_default=True, help="0 is greedy.")
@click.option("--top-p", type=Finite(0, 1, min_open=True),
              default=GENERATE_DEFAULTS["top_p"], show_default=True)
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=GENERATE_DEFAULTS["seed"],
              show_default=True)
@click.option("--stop-token-ids", default="", help="Comma-separated ids that end the output.")
@click.option("--min-seq", type=click.IntRange(0, MAX_SEQ),
              default=GENERATE_DEFAULTS["min_seq"],
              show_default=True,
              help="Wait until the replica has applied this seq (read your own load).")
@click.option("--replica-server-key", envvar="LORAPLANE_REPLICA_SERVER_KEY", default=None,
              help="CURVE: the replica's public key file, when it runs with --auth "
                   "(env LORAPLANE_REPLICA_SERVER_KEY); your key is --key.")
@JSON_OPT
@click.pass_context
@handles_errors
def generate(ctx: click.Context, replica: str, adapter: str | None, input_ids: str | None,
             prompt: str | None, model: Path | None, max_new_tokens: int, temperature: float, top_p: float, seed: int,
             stop_token_ids: str, min_seq: int, replica_server_key: str | None,
             as_json: bool) -> None:
    """Ask a replica for a completion, on an adapter or on the base model."""
    if (input_ids is None) == (prompt is None):
        raise click.UsageError("give the prompt as --input-ids or as --prompt (one of them)")
    codec = None
    if prompt is not None:
        if model is None:
            raise click.UsageError("--prompt needs --model DIR, the base model whose "
                                   "tokenizer.json turns text into token ids")
        from shared.text import NoTokenizer, TextCodec
        try:
            codec = TextCodec.load(model)
        except NoTokenizer as exc:
            raise click.UsageError(str(exc))
        ids = codec.encode(prompt)
        if not ids:
            raise click.BadParameter("the prompt is empty", param_hint="--prompt")
    else:
        assert input_ids is not None
        ids = _parse_ids(input_ids, "--input-ids")
    args = generate_args(ids, adapter=adapter, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, seed=seed,
                         stop_token_ids=(_parse_ids(stop_token_ids, "--stop-token-ids")
                                         if stop_token_ids else []),
                         min_seq=min_seq)
    keys_ = keys_of(ctx.obj["key"], replica_server_key) if replica_server_key else None
    with ControlClient(replica, timeout_s=max(ctx.obj["timeout"], 60.0), retries=0,
                       keys=keys_) as c:
        res = c.call(GENERATE, args)
    if codec is not None:
        res["text"] = codec.decode(res["output_ids"])
    if as_json:
        emit(res)
        return
    who = (f"{res['adapter']['name']} v{res['adapter']['version']}" if res["adapter"]
           else "base model")
    out.print(terminal_safe(f"{who} (replica at seq {res['seq']}): "
                    f"{','.join(map(str, res['output_ids']))}"))
    if codec is not None:
        out.print(terminal_safe(res["text"]))
    t = res["timings"]
    out.print("[dim]" + terminal_safe(f"queue {t['queue_ms']:.1f} ms, prefill {t['prefill_ms']:.1f} ms, "
                              f"decode {t['decode_ms']:.1f} ms, total {t['total_ms']:.1f} ms")
              + "[/]")


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


main.add_command(drill)
main.add_command(make_example_cmd)


if __name__ == "__main__":
    main()
