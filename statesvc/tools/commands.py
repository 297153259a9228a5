"""loractl's tool commands: the recovery drill and the example model's writer."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from shared.config import DEFAULT_PUBLISH
from shared.endpoints import click_addresses
from shared.modelconfig import FAMILIES
from statesvc.console import JSON_OPT, emit, err, handles_errors, keys_of, out, terminal_safe
from statesvc.tools.families import FAMILIES as EXAMPLE_FAMILIES
from statesvc.tools.presets import PRESETS

# the families a replica serves that the example writer has an entry for
EXAMPLE_CHOICES = tuple(f for f in FAMILIES if f in EXAMPLE_FAMILIES)


@click.command()
@click.option("--kill", "kill", default=None, metavar="REPLICA_ID",
              help="Also SIGKILL this replica, restart it and time its recovery; what to kill "
                   "and run comes from its run file (--run-file), never from the network.")
@click.option("--run-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The --kill replica's run file, written by `computed serve` into its cache "
                   "dir [default: ./var/replicas/REPLICA_ID/run.json].")
@click.option("--kill-statesvc", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, metavar="DATA_DIR",
              help="With several instances of one log (--state a,b): SIGKILL the statesvc of "
                   "this data dir (from its run.json), check that every live replica stays "
                   "ACTIVE through the others, and restart it.")
@click.option("--replica-server-key", envvar="LORAPLANE_REPLICA_SERVER_KEY", default=None,
              help="CURVE: the live replicas' public key file when they run with --auth (env "
                   "LORAPLANE_REPLICA_SERVER_KEY); your --key must be in their operators/.")
@click.option("--diffs", envvar="LORAPLANE_DIFFS", default=DEFAULT_PUBLISH, show_default=True,
              callback=click_addresses,
              help="statesvc's diff address, for the drill's fresh replicas (a,b: one per "
                   "--state instance).")
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="Base model dir [default: the --kill replica's run file's, "
                                 "else what the live replicas report].")
@click.option("--resident-only", is_flag=True,
              help="Probe each live replica only on the adapters it holds: no probe fills a "
                   "slot there (check no_fills). The registry is still compared by digest, and "
                   "the drill's own replicas probe every live adapter.")
@JSON_OPT
@click.pass_context
@handles_errors
def drill(ctx: click.Context, kill: str | None, run_file: Path | None,
          kill_statesvc: Path | None,
          replica_server_key: str | None, diffs: str, model: Path | None,
          resident_only: bool, as_json: bool) -> None:
    """Rebuild replicas from the log (from seq 0 and from the latest snapshot) and prove
    that they agree with every live replica and with statesvc. Exit 1 on any disagreement."""
    from rich.progress import BarColumn, Progress, TaskID, TextColumn

    from statesvc.tools.drill import Drill, DrillError

    bars: dict[str, TaskID] = {}
    with Progress(TextColumn("{task.description:<22}"), BarColumn(),
                  TextColumn("seq {task.completed:.0f}/{task.total:.0f}"), console=err,
                  disable=as_json or not err.is_terminal, transient=True) as progress:
        def show(name: str, seq: int, head: int) -> None:
            if name not in bars:
                bars[name] = progress.add_task(name, total=max(head, 1))
            progress.update(bars[name], completed=seq, total=max(head, 1))

        try:
            keyed = keys_of(ctx.obj["key"], ctx.obj["server_key"]) is not None
            replica_keys = (keys_of(ctx.obj["key"], replica_server_key) if replica_server_key
                            else None)
            report = Drill(ctx.obj["state"], diffs, model=model, progress=show,
                           key_files=(ctx.obj["key"], ctx.obj["server_key"]) if keyed
                           else None, replica_keys=replica_keys,
                           resident_only=resident_only).run(
                               kill, run_file=run_file, kill_statesvc=kill_statesvc)
        except DrillError as exc:
            err.print(f"[bold red]error[/] (drill): {terminal_safe(exc)}")
            sys.exit(3)
    if as_json:
        emit(report.to_json())
    else:
        table = Table(title=f"drill at seq {report.head_seq}: "
                      + ("[green]all agree[/]" if report.ok else "[bold red]DISAGREEMENT[/]"))
        for col in ("replica", "check", "result", "detail"):
            table.add_column(col)
        for c in report.checks:
            table.add_row(terminal_safe(c.replica), terminal_safe(c.check),
                          "[green]ok[/]" if c.ok else "[bold red]DIFFERS[/]",
                          terminal_safe(c.detail))
        out.print(table)
        out.print("  ".join(f"{k} {v:.2f} s" for k, v in report.timings.items()))
    for c in report.checks:
        if not c.ok:
            err.print(f"[bold red]disagreement[/]: replica {terminal_safe(c.replica)}: "
                      f"{terminal_safe(c.check)} {terminal_safe(c.detail)}")
    sys.exit(0 if report.ok else 1)


@click.command("make-example")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
@click.option("--family", type=click.Choice(EXAMPLE_CHOICES), default=None,
              help="The model family (config.json model_type) of the checkpoint, with that "
                   "family's tokenizer and chat template (docs/adapters.md, the families served) "
                   "[default: llama, or the preset's].")
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), default=None,
              help="A public checkpoint's geometry instead of the tiny example: its sizes and "
                   "config, random bfloat16 weights, rank-16 adapters on all seven projections "
                   "(statesvc/tools/presets.py).")
@click.option("--adapters", "n_adapters", type=click.IntRange(0), default=None,
              help="With --preset: how many adapters to write [default: 4].")
@JSON_OPT
def make_example_cmd(directory: Path, seed: int, family: str | None, preset_name: str | None,
                     n_adapters: int | None, as_json: bool) -> None:
    """Write a random checkpoint of one model family, with its tokenizer, and PEFT adapters
    (nothing is downloaded): a tiny one, or a real model's geometry with --preset."""
    from statesvc.tools.example import make_example

    try:
        str(directory.resolve()).encode()
    except UnicodeEncodeError:  # the tokenizer library takes UTF-8 paths only
        raise click.BadParameter(f"{str(directory)!r} is not valid UTF-8 text; choose a "
                                 "directory whose path is", param_hint="DIRECTORY") from None
    if n_adapters is not None and preset_name is None:
        raise click.UsageError("--adapters counts a preset's adapters: pass --preset too (the tiny "
                               "example writes its own five)")
    kwargs: dict[str, Any] = {}
    if preset_name is not None:
        chosen = PRESETS[preset_name]
        if family is not None and family != chosen.family:
            raise click.UsageError(f"--preset {preset_name} is a {chosen.family} checkpoint, not "
                                   f"--family {family}: drop --family or pass --family {chosen.family}")
        family = chosen.family
        kwargs = dict(shape=chosen.shape, dtype=chosen.dtype, config=chosen.config,
                      adapters=chosen.adapters(4 if n_adapters is None else n_adapters),
                      base_model_name_or_path=f"loraplane/random-{preset_name}")
    family = family or "llama"
    t0 = time.perf_counter()
    try:
        assets = make_example(directory, seed=seed, family=family, **kwargs)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename not in (None, str(directory)) else ""
        raise click.UsageError(f"DIRECTORY {directory}: {exc.strerror or exc}{where}; choose "
                               "a directory this user can create and write") from None
    res: dict[str, Any] = {"family": family, "model": str(assets.model_dir.resolve()),
           "adapters": {n: str(p.resolve()) for n, p in sorted(assets.adapter_dirs.items())}}
    if as_json:
        emit(res)
    else:
        out.print(f"model    {res['model']} ({family})")
        for n, p in res["adapters"].items():
            out.print(f"adapter  {n:<16} {p}")
        out.print(f"written in {time.perf_counter() - t0:.2f} s")
