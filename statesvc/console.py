"""What loractl prints, and how: the consoles, JSON for scripts, wire text made safe, and
the error exits every command shares (1: the service refused; 3: no answer)."""
from __future__ import annotations

import functools
import json
import sys
import unicodedata
from typing import Any, Callable, TypeVar

import click
from rich.console import Console
from rich.markup import escape

from shared.client import RemoteError, Unavailable
from shared.keys import ClientKeys, KeyError_, client_keys

F = TypeVar("F", bound=Callable[..., Any])
out = Console(highlight=False, soft_wrap=True, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)

JSON_OPT = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


def terminal_safe(value: Any) -> str:
    """A value from the wire as text to print: control and format characters as escapes
    (\\x1b, \\u202e: nothing moves the cursor or recolours the terminal), rich markup escaped
    (printed as written, never parsed, so `[/x]` in a name cannot crash the print)."""
    return escape("".join(ch.encode("unicode_escape").decode("ascii")
                          if unicodedata.category(ch) in ("Cc", "Cf") else ch
                          for ch in str(value)))


def emit(value: Any) -> None:
    click.echo(json.dumps(value, indent=None, sort_keys=False))


def handles_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RemoteError as exc:
            err.print(f"[bold red]error[/] ({terminal_safe(exc.code)}): {terminal_safe(exc)}")
            sys.exit(1)
        except Unavailable as exc:
            err.print(f"[bold red]error[/] (unavailable): {terminal_safe(exc)}")
            sys.exit(3)
    return wrapper  # type: ignore[return-value]


def keys_of(key: str | None, server_key: str | None) -> ClientKeys | None:
    """CURVE keys for a server from key files; None without either."""
    try:
        return client_keys(key, server_key)
    except KeyError_ as exc:
        raise click.UsageError(str(exc)) from None
