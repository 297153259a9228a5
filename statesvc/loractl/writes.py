"""loractl's writes: `pool init`, `load` and `unload`, each sent under one event id
(client.write) and answered in a line."""
from __future__ import annotations

from pathlib import Path

import click

from shared.config import DEFAULT_MAX_ADAPTERS, MAX_MAX_ADAPTERS, POOL_DTYPES
from statesvc.console import JSON_OPT, emit, handles_errors, out, terminal_safe
from statesvc.loractl.client import write
from statesvc.loractl.options import EVENT_ID, EXPECT_HEAD, TEXT, parse_targets, wire_path


@click.group()
def pool() -> None:
    """The memory pool's immutable settings."""


@pool.command("init")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False,
                                                        path_type=Path), callback=wire_path,
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
    res = write(ctx, "pool.init", {"event_id": event_id, "model": str(model.resolve()),
                                   "max_loras": max_loras, "max_adapters": max_adapters,
                                   "max_rank": max_rank, "targets": parse_targets(targets),
                                   "dtype": dtype, "expect_head": expect_head})
    if as_json:
        emit(res)
    else:
        verb = "configured" if res["created"] else "already configured with these settings"
        out.print(terminal_safe(f"pool {verb} at seq {res['seq']}: {res['max_loras']} slots "
                                f"per replica, up to {res['max_adapters']} adapters, max rank "
                                f"{res['max_rank']}, targets {','.join(res['targets'])}, "
                                f"{res['dtype']}, model {res['fingerprint'][:12]}"))


@click.command()
@click.argument("name", type=TEXT)
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path),
                callback=wire_path)
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
    res = write(ctx, "load", {"event_id": event_id, "name": name, "path": str(path.resolve()),
                              "pin": pin, "replace": replace, "expect_head": expect_head})
    if as_json:
        emit({k: res[k] for k in ("seq", "name", "version")})
    elif res["created"]:
        out.print(terminal_safe(f"loaded {res['name']} version {res['version']} "
                                f"(seq {res['seq']})"))
    else:
        out.print(terminal_safe(f"{res['name']} is already loaded with this content: version "
                                f"{res['version']}; nothing recorded"))


@click.command()
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
    res = write(ctx, "unload", {"event_id": event_id, "name": name, "force": force,
                                "expect_head": expect_head})
    if as_json:
        emit(res)
    else:
        out.print(terminal_safe(f"unloaded {res['name']} version {res['version']} "
                                f"(seq {res['seq']})"))
