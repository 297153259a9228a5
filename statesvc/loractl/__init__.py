"""loractl: the operators' CLI for the state service.

Every command takes --json for scripts; without it, readable tables. Errors go
to stderr: exit 1 when the service refused the command, 3 when it did not
answer (2 is a usage error, as click reports it). Everything a service or a
replica sent is printed through `terminal_safe` (statesvc/console.py): no terminal
control sequence and no rich markup from the wire reaches the terminal.

One module per role: `cli.py` (the command group, its global options, `keys new`),
`options.py` (what the command line takes: values the wire can carry), `client.py` (the
control client; a write resent under one event id), `writes.py` (`pool init`, `load`,
`unload`), `reads.py` (`list`, `events`, `status`), `generate.py`, `tables.py` (how answers
are printed); `drill` and `make-example` are in statesvc/tools/commands.py.
"""
from __future__ import annotations

from statesvc.loractl.cli import main

__all__ = ["main"]
