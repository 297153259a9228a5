"""Tool calls, the request's side: a chat's `tools`, `tool_choice` and `parallel_tool_calls`
read and checked, and the tool-call keys of its messages (docs/structured-outputs.md, "Tool
calls"). The answer's side (the family's format, its grammar, the answer parsed and streamed
into OpenAI's `tool_calls`) is gateway/tool_calls.py."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict[str, Any], ...]  # OpenAI's {"type": "function", "function": {...}}
    choice: str  # none, auto, required, or named (then `name`)
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: false allows at most one call

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def parameters(self, name: str) -> Any:
        return next(f["function"].get("parameters", NO_PARAMETERS) for f in self.functions
                    if f["function"]["name"] == name)

    @property
    def names(self) -> list[str]:
        return [f["function"]["name"] for f in self.functions]


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """`tools` and `tool_choice` of a chat body; None when no tool may be called."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    parallel = parallel is not False
    if raw is None:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice needs tools: send the functions the model may call",
                      "tool_choice")
        return None
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_TOOLS:
        raise bad(f"tools must be a list of 1 to {MAX_TOOLS} tools", "tools")
    functions = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad("tools name the same function twice", "tools")
    if choice is None or choice in CHOICES:
        return Tools(functions, choice or "auto", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad(f"tool_choice names the function {name!r}, which is not one of the "
                      f"tools ({', '.join(names)})", "tool_choice.function.name")
        return Tools(functions, "named", name, parallel)
    raise bad('tool_choice must be "none", "auto", "required" or {"type": "function", '
              '"function": {"name": ...}}', "tool_choice")


def _tool(t: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or \
            not isinstance(t.get("function"), dict):
        raise bad(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    f = t["function"]
    unknown = sorted(set(f) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise bad(f"{where}.function.{unknown[0]} is not supported",
                  f"{where}.function.{unknown[0]}")
    if not isinstance(f.get("name"), str) or not NAME.fullmatch(f["name"]):
        raise bad(f"{where}.function.name must be 1 to 64 letters, digits, _, . or -",
                  f"{where}.function.name")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise bad(f"{where}.function.description must be a string",
                  f"{where}.function.description")
    if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
        raise bad(f"{where}.function.parameters must be a JSON schema (an object)",
                  f"{where}.function.parameters")
    return {"type": "function", "function": {k: v for k, v in f.items() if v is not None}}


def message_fields(m: dict[str, Any], where: str) -> dict[str, Any]:
    """The tool-call keys of one chat message, as its template renders them: an assistant's
    `tool_calls` (arguments parsed from their JSON text, as vLLM passes them), a tool
    result's `tool_call_id` and `name`."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise bad(f"{where}.tool_calls must be a list, on an assistant message",
                      f"{where}.tool_calls")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if not isinstance(m[key], str) or len(m[key]) > 256:
                raise bad(f"{where}.{key} must be a string of at most 256 characters",
                          f"{where}.{key}")
            out[key] = m[key]
    return out


def _call(c: Any, where: str) -> dict[str, Any]:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise bad(f'{where} must be {{"id", "type": "function", "function": {{"name", '
                  f'"arguments"}}}}', where)
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise bad(f"{where}.function.arguments must be JSON text", f"{where}.function.arguments")
    return {"id": str(c.get("id", "")), "type": "function",
            "function": {"name": f["name"], "arguments": args}}
