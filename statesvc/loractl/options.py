"""What loractl's command line takes: values the wire can carry, so a value beyond what the
services take is a usage error naming the option (exit 2), never a frame that cannot be
encoded."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

from shared.config import MAX_SEQ, UUID_RE
from shared.errors import short_int
from shared.projections import MODULES

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


def wire_path(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
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
EXPECT_HEAD = click.option("--expect-head", type=click.IntRange(0, MAX_SEQ), default=None,
                           help="Refuse (conflict) unless the log's head is at this seq.")


def parse_targets(value: str) -> str | list[str]:
    """--targets: 'all', or a comma list of module names."""
    if value == "all":
        return "all"
    targets = [t.strip() for t in value.split(",") if t.strip()]
    unknown = [t for t in targets if t not in MODULES]
    if unknown or not targets:
        raise click.BadParameter(f"unknown module(s) {unknown}; use 'all' or a comma-separated "
                                 f"list of {', '.join(MODULES)}")
    return targets


def parse_ids(value: str, option: str) -> list[int]:
    """Comma-separated token ids given as `option`."""
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
