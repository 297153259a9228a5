"""Tool calls, the answer's side: the family's format found in its chat template, the grammar
of a forced call, and the model's answer split into content and OpenAI's `tool_calls`, whole
(`Format.parse`) or as it streams (`ToolStream`, OpenAI's `delta.tool_calls`), by one scanner:
a stream's deltas join to exactly the whole answer's calls, ids included
(docs/structured-outputs.md, "Tool calls").

Formats, by what the chat template writes: Qwen2.5's and Qwen3's Hermes-style
`<tool_call>{"name", "arguments"}</tool_call>`, Llama 3.1's JSON `{"name", "parameters"}`
(its template has an `ipython` role; several separated by `;`, an optional `<|python_tag|>`
first), Mistral's `[TOOL_CALLS] [{"name", "arguments"}]`."""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.grammar import JSON_OPTIONS, Grammar

if TYPE_CHECKING:
    from gateway.output import Output
    from gateway.requests import Chat
    from gateway.tools import Tools

WHITESPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")
PYTHON_TAG = "<|python_tag|>"


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

    def parse(self, text: str, stem: str | None = None, *, one: bool = False
              ) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool calls) of a whole answer; calls that do not parse leave it all
        content. `stem` makes the calls' ids (`ToolStream`); `one`: the first call alone."""
        stream = ToolStream(self, stem, one=one)
        stream.push(text)
        calls = stream.calls()
        return (stream.content, calls) if calls else (text, [])


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


def call_stem(req: Chat) -> str:
    """What a request's call ids are made from: its model, messages, tools and seed, so that
    the same request with the same seed has the same ids, streamed or not, and another turn
    of the chat (other messages) has others."""
    tools = None if req.tools is None else list(req.tools.functions)
    key = json.dumps([req.model, req.messages, tools, req.sampling.seed], sort_keys=True,
                     default=str)
    return hashlib.sha256(key.encode()).hexdigest()


class _Object:
    """One call's JSON object as its text comes, from its `{`: its name once read, and its
    arguments' text (the value of `arguments` or `parameters`, as the model wrote it) as far
    as it has come. `bad` when it cannot be a call."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_str = self.esc = False
        self.role: str | None = None  # of the string being read at depth 1: key or value
        self.expect = "key"  # at depth 1: key, colon, value, or past (a value read or being read)
        self.key_at = self.value_at = 0
        self.key = ""
        self.reading: str | None = None  # the depth-1 value being read: name, args or other
        self.name: str | None = None
        self.args_at: int | None = None
        self.args_end: int | None = None
        self.closed = self.bad = False

    def feed(self, s: str) -> int:
        """Take the characters of `s` up to the object's end; how many it took."""
        for i, ch in enumerate(s):
            pos = len(self.text)
            self.text += ch
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.role == "key":
                        self.key, self.expect = json.loads(self.text[self.key_at:]), "colon"
                    elif self.role == "value":
                        self._value_end(pos + 1)
                    self.role = None
            elif ch == '"':
                self.in_str = True
                if self.depth == 1 and self.expect == "key":
                    self.role, self.key_at = "key", pos
                elif self.depth == 1:
                    self.role = "value" if self._value_start(pos, ch) else None
            elif ch in "{[":
                self.depth += 1
                if self.depth == 2:
                    self._value_start(pos, ch)
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and self.reading is not None:
                    self._value_end(pos + 1)
                elif self.depth == 0:
                    self.closed = True
                    self._check()
                    return i + 1
            elif self.depth == 1 and ch not in WHITESPACE:
                if ch == ":" and self.expect == "colon":
                    self.expect = "value"
                elif ch == ",":
                    self.expect, self.reading = "key", None
                elif self.expect == "value":  # a number, true, false or null
                    self._value_start(pos, ch)
                    self.reading = None
        return len(s)

    def _value_start(self, pos: int, ch: str) -> bool:
        """A depth-1 value begins at `pos` with `ch`: whether it is one this reads."""
        if self.expect != "value":
            self.bad = True
            return False
        self.expect, self.value_at = "past", pos
        if self.key == "name" and self.name is None:
            self.reading = "name"
            self.bad |= ch != '"'
        elif self.key in ARGUMENT_KEYS and self.args_at is None:
            self.reading, self.args_at = "args", pos
            self.bad |= ch != "{"
        else:
            self.reading = "other"
        return True

    def _value_end(self, end: int) -> None:
        if self.reading == "name":
            self.name = json.loads(self.text[self.value_at:end])
        elif self.reading == "args":
            self.args_end = end
        self.reading = None

    def _check(self) -> None:
        try:
            obj = json.loads(self.text)
        except ValueError:
            self.bad = True
            return
        self.bad |= not isinstance(obj, dict) or not isinstance(self.name, str) or \
            obj.get("name") != self.name

    def arguments(self) -> str:
        """The arguments' text so far (`{}` for a closed call without them)."""
        if self.args_at is None:
            return "{}" if self.closed else ""
        return self.text[self.args_at:self.args_end]


# where a scan may end with its calls whole, by format (and "done": the one call of `one`)
ENDS = {"hermes": ("after",), "mistral": ("end",), "llama_json": ("next", "sep")}


class ToolStream:
    """One choice's answer as its text comes, split into content and OpenAI's tool-call deltas.
    `push` takes the next piece of text and returns the content it releases (held back from
    where a call may begin: the marker, any end of the text that may still become one; for
    Llama's JSON, an answer that begins with `{` or its python tag) and the deltas it completes:
    a call's first (`index`, `id`, `type`, `function.name`, `function.arguments` as far as it
    has come, "" when the name comes first) once its name is read, then `index` and each new
    piece of `function.arguments`, the model's own text of the arguments object. A call's id is
    `call_` and 24 hex digits of the hash of `stem` and its index (a fresh random stem when
    None). With `one` (parallel_tool_calls false) the first call is the only one: what follows
    it is neither content nor a call, and `done` says it has ended."""

    def __init__(self, fmt: Format, stem: str | None = None, *, one: bool = False,
                 marker_id: int | None = None) -> None:
        self.fmt, self.one, self.marker_id = fmt, one, marker_id
        self.stem = uuid.uuid4().hex if stem is None else stem
        self.text = ""
        self.at = 0  # characters of `text` scanned
        self.find_from = 0  # where the search for the next marker starts
        self.released = 0  # characters of content released
        self.state = "content"
        self.start: int | None = None  # where the first call begins: the content's end
        self.objects: list[_Object] = []
        self.sent: list[int | None] = []  # each call's argument characters sent (None: not begun)
        self.single = False  # Mistral's one object without its list

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def content(self) -> str:
        return self.text if self.start is None else self.text[:self.start]

    def calls(self) -> list[dict[str, Any]]:
        """The answer's calls, whole, once its text has all come: none when one does not parse."""
        if self.state not in ENDS[self.fmt.name] + ("done",) or \
                any(o.bad or not o.closed for o in self.objects):
            return []
        return [{"id": self._id(k), "type": "function",
                 "function": {"name": o.name, "arguments": o.arguments()}}
                for k, o in enumerate(self.objects)]

    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += piece
        touched: list[int] = []
        while self.at < len(self.text) and self.state not in ("done", "failed", "plain"):
            self._step(touched)
        end = len(self.text) - self._held() if self.start is None else self.start
        content = self.text[self.released:max(end, self.released)]
        self.released += len(content)
        return content, [d for k in touched if (d := self._delta(k)) is not None]

    def token(self, token: int, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """`push` of a streamed token's text: a marker that is one special token (which the
        text leaves out) as its text."""
        return self.push(piece + self.fmt.marker if token == self.marker_id else piece)

    def rest(self, out: Output) -> tuple[str, list[dict[str, Any]]]:
        """At the stream's end, what it has not sent of the choice's output: the content left
        (text held back) and, where the output has calls, the deltas left of them."""
        sent = self.released
        source = out.tool_source
        _, deltas = self.push(source[len(self.text):]) \
            if source is not None and source.startswith(self.text) else ("", [])
        return out.text[sent:], deltas if out.tool_calls else []

    def _id(self, k: int) -> str:
        return "call_" + hashlib.sha256(f"{self.stem}/{k}".encode()).hexdigest()[:24]

    def _held(self) -> int:
        """How much of the end of the text may still begin a call (before any has)."""
        if self.state == "plain":
            return 0
        if self.fmt.name == "llama_json":
            return len(self.text)
        marker = self.fmt.marker
        return max((k for k in range(min(len(marker) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(marker[:k])), default=0)

    def _step(self, touched: list[int]) -> None:
        """Scan on from `at`: one state's worth."""
        state, text, fmt = self.state, self.text, self.fmt
        if state == "object":
            obj = self.objects[-1]
            self.at += obj.feed(text[self.at:])
            if not touched or touched[-1] != len(self.objects) - 1:
                touched.append(len(self.objects) - 1)
            if obj.closed:
                self.state = "failed" if obj.bad else "done" if self.one else {
                    "hermes": "after", "llama_json": "sep"}.get(
                        fmt.name, "end" if self.single else "sep")
                self.find_from = self.at
            return
        if state in ("content", "after") and fmt.name != "llama_json":
            at = text.find(fmt.marker, self.find_from)
            if at < 0:  # the next search starts where the marker may still begin
                self.find_from = max(self.find_from, len(text) - len(fmt.marker) + 1)
                self.at = len(text)
                return
            if self.start is None:
                self.start = at
            self.at, self.state = at + len(fmt.marker), "open"
            return
        if state == "content":  # Llama's JSON: a call is the whole answer
            head = text.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                self.at = len(text)
            elif head.startswith(("{", PYTHON_TAG)):
                self.start, self.state = 0, "open"
                self.at = len(text) - len(head) + (len(PYTHON_TAG) if head[0] != "{" else 0)
            else:
                self.state = "plain"
            return
        ch = text[self.at]
        if ch in WHITESPACE:
            self.at += 1
            return
        if state == "end":
            self.state = "failed"
            return
        if ch == "{" and (state in ("open", "next") or fmt.name == "llama_json" and state == "sep"):
            self.single = self.single or state == "open" and fmt.name == "mistral"
            self.objects.append(_Object())
            self.sent.append(None)
            self.state = "object"
        elif state == "open" and ch == "[" and fmt.name == "mistral":
            self.at, self.state = self.at + 1, "next"
        elif state == "sep" and ch == ("," if fmt.name == "mistral" else ";"):
            self.at, self.state = self.at + 1, "next"
        elif state == "sep" and ch == "]" and fmt.name == "mistral":
            self.at, self.state = self.at + 1, "end"
        else:
            self.state = "failed"

    def _delta(self, k: int) -> dict[str, Any] | None:
        """Call `k`'s delta of what this push read of it; None when there is nothing to send."""
        obj = self.objects[k]
        if obj.bad or obj.name is None:
            return None
        args, sent = obj.arguments(), self.sent[k]
        self.sent[k] = len(args)
        if sent is None:
            return {"index": k, "id": self._id(k), "type": "function",
                    "function": {"name": obj.name, "arguments": args}}
        return {"index": k, "function": {"arguments": args[sent:]}} if len(args) > sent else None
