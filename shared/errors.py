"""The coded error: what every refusal carries into an error reply.

`code` is the wire's `error.code` (docs/protocol.md lists them), the message
says what is wrong and how to fix it, and `field` names the request field at
fault (None: the request as a whole). Each refusal keeps its own subclass, so
callers catch what they mean; whatever turns one into a reply or into another
kind reads these three attributes of the base class.
"""
from __future__ import annotations


class CodedError(Exception):
    """A refusal with a stable code, a message for people and the field at fault."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


def cause(exc: BaseException) -> str:
    """The first line of an error's own message, a database driver's where SQLAlchemy wraps
    one (`orig`): SQLAlchemy's text adds the statement, its parameters and a link, which an
    answer to a client or a log line has no use for."""
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def short_int(value: int) -> str:
    """An integer as a message shows it: whole up to 24 digits, else its first 8 and last 4
    digits and how many there are (a JSON or command-line integer can have thousands)."""
    digits = str(abs(value))
    if len(digits) <= 24:
        return str(value)
    return f"{'-' * (value < 0)}{digits[:8]}...{digits[-4:]} ({len(digits)} digits)"
