"""Tool calls: a chat's `tools` and `tool_choice` read and checked, the family's tool-call
format found in its chat template, the model's answer parsed into OpenAI's `tool_calls`, and
for `required` and named calls the grammar that makes the answer a call that parses
(docs/gateway.md, "Tool calls").

Formats, by what the chat template writes: Qwen2.5's and Qwen3's Hermes-style
`<tool_call>{"name", "arguments"}</tool_call>`, Llama 3.1's JSON `{"name", "parameters"}`
(its template has an `ipython` role), Mistral's `[TOOL_CALLS] [{"name", "arguments"}]`."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad
from shared.grammar import JSON_OPTIONS, Grammar

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict[str, Any], ...]  # OpenAI's {"type": "function", "function": {...}}
    choice: str  # none, auto, required, or named (then `name`)
    name: str | None = None

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
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
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
        return Tools(functions, choice or "auto")
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad(f"tool_choice names the function {name!r}, which is not one of the "
                      f"tools ({', '.join(names)})", "tool_choice.function.name")
        return Tools(functions, "named", name)
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


@dataclass(frozen=True)
class Format:
    """A family's tool-call format."""

    name: str
    marker: str  # what begins a call in the answer
    key: str  # the call's arguments key

    def _one(self, name: str, parameters: Any) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": name}, self.key: parameters},
                "required": ["name", self.key], "additionalProperties": False}

    def grammar(self, tools: Tools, marker_id: int | None = None) -> Grammar:
        """The grammar of one call of `tools.name` (named) or of any of the tools (required)."""
        names = [tools.name] if tools.name is not None else tools.names
        calls = [self._one(n, tools.parameters(n)) for n in names]
        schema = {"x-guidance": JSON_OPTIONS, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
        marker = f"<[{marker_id}]>" if marker_id is not None else json.dumps(self.marker)
        body = "%json " + json.dumps(schema)
        if self.name == "hermes":
            rule = f'{marker} "\\n" {body} "\\n</tool_call>"'
        elif self.name == "mistral":
            rule = f'{marker} " [" {body} "]"'
        else:
            rule = body
        return Grammar("lark", f"start: {rule}")

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool calls) of an answer; calls that do not parse leave it all content."""
        try:
            if self.name == "llama_json":
                calls = _llama_calls(text)
                return ("", calls) if calls else (text, [])
            at = text.find(self.marker)
            if at < 0:
                return text, []
            if self.name == "hermes":
                found = [json.loads(s) for s in re.findall(
                    r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[at:], re.DOTALL)]
            else:
                found = json.loads(text[at + len(self.marker):].strip())
                found = found if isinstance(found, list) else [found]
            calls = [_checked(c, self.key) for c in found]
        except ValueError:
            return text, []
        return text[:at], calls

    def starts(self, text: str) -> int | None:
        """Where a call begins in streamed `text` (None: none yet); the end of `text` that
        may still become one is held by `held`."""
        if self.name == "llama_json":
            head = text.lstrip()
            return 0 if head.startswith(("{", "<|python_tag|>")) else None
        at = text.find(self.marker)
        return None if at < 0 else at

    def held(self, text: str) -> int:
        if self.name == "llama_json":
            head = text.lstrip()
            return len(text) if not head or "<|python_tag|>".startswith(head) else 0
        return max((k for k in range(min(len(self.marker) - 1, len(text)), 0, -1)
                    if text.endswith(self.marker[:k])), default=0)


def _llama_calls(text: str) -> list[dict[str, Any]]:
    rest = text.strip().removeprefix("<|python_tag|>").strip()
    if not rest.startswith("{"):
        return []
    decoder, calls = json.JSONDecoder(), []
    while rest:
        obj, end = decoder.raw_decode(rest)
        calls.append(_checked(obj, "parameters"))
        rest = rest[end:].strip().removeprefix(";").strip()
    return calls


def _checked(c: Any, key: str) -> dict[str, Any]:
    """One parsed call as OpenAI's tool_calls entry; ValueError when it is not a call."""
    if not isinstance(c, dict) or not isinstance(c.get("name"), str):
        raise ValueError("not a call")
    args = c.get(key, c.get("arguments", c.get("parameters", {})))
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(args)}}


HERMES = Format("hermes", "<tool_call>", "arguments")
LLAMA_JSON = Format("llama_json", "{", "parameters")
MISTRAL = Format("mistral", "[TOOL_CALLS]", "arguments")


def format_of(template: str | None) -> Format | None:
    """The tool-call format a chat template writes; None when it has none."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "ipython" in template:
        return LLAMA_JSON
    return None


class ToolStream:
    """A streamed answer's content pieces, held back from where a tool call may begin: what
    `push` returns is content; the calls come whole at the end (`Output.tool_calls`)."""

    def __init__(self, fmt: Format, forced: bool) -> None:
        self.fmt, self.forced = fmt, forced
        self.text = ""
        self.released = 0
        self.calling = forced

    def push(self, piece: str) -> str:
        self.text += piece
        if self.calling:
            return ""
        at = self.fmt.starts(self.text)
        end = at if at is not None else len(self.text) - self.fmt.held(self.text)
        self.calling = at is not None
        out = self.text[self.released:max(end, self.released)]
        self.released += len(out)
        return out
