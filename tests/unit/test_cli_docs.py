"""docs/cli.md is what `python -m tools.cli_docs` makes of the commands' click definitions, so the
reference cannot drift from the code; and the generator gives the same bytes whatever the
terminal or the environment."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click

from tools.cli_docs import CLI_DOC, TOOLS, render

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_reference_is_the_generators_output() -> None:
    assert CLI_DOC.read_text() == render(), (
        "docs/cli.md differs from the commands' definitions: run "
        "`python -m tools.cli_docs --write` and commit docs/cli.md")


def _generated(**env: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "tools.cli_docs"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_reference_does_not_depend_on_the_terminal_or_the_environment() -> None:
    # a narrow terminal, and the variables the tools read their defaults from set otherwise
    narrow = _generated(COLUMNS="20", LINES="5", TERM="dumb",
                        LORAPLANE_STATE="tcp://10.1.2.3:9", LORAPLANE_DIFFS="tcp://10.1.2.3:10",
                        LORAPLANE_KEY="/nonexistent/me.key_secret")
    wide = _generated(COLUMNS="400", LINES="200", TERM="xterm-256color")
    assert narrow == wide == CLI_DOC.read_text()


def test_every_visible_option_and_command_is_in_the_reference() -> None:
    text = render()
    seen = 0

    def walk(command: click.Command, ctx: click.Context) -> None:
        nonlocal seen
        heading = f"`{ctx.command_path}`\n"
        assert heading in text, ctx.command_path
        section = text.split(heading, 1)[1].split("\n#", 1)[0]
        for p in command.params:
            if isinstance(p, click.Option) and not p.hidden:
                for flag in (*p.opts, *p.secondary_opts):
                    assert f"`{flag}`" in section, f"{ctx.command_path} {flag}"
                    seen += 1
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, click.Context(sub, info_name=name, parent=ctx))

    for tool in TOOLS:
        walk(tool.command(), click.Context(tool.command(), info_name=tool.name))
    assert seen > 50  # the walk reached the services' options, not only the groups'


def test_check_mode_fails_on_a_reference_that_drifted(tmp_path: Path) -> None:
    drifted = tmp_path / "cli.md"
    drifted.write_text(render().replace("Upgrade the event store's schema", "Do something else"))
    proc = subprocess.run([sys.executable, "-m", "tools.cli_docs", "--check", "--file", str(drifted)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "python -m tools.cli_docs --write" in proc.stderr
    same = tmp_path / "same.md"
    same.write_text(render())
    ok = subprocess.run([sys.executable, "-m", "tools.cli_docs", "--check", "--file", str(same)],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
