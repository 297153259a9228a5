"""Text in and out of a checkpoint: its tokenizer.json (the `tokenizers` library), the chat
template of its tokenizer_config.json rendered as transformers' apply_chat_template renders
it, and incremental detokenization that never splits a multi-byte character."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

COMPOSED_CHARS = 4  # the most characters canonical composition (NFC, NFKC) makes one of: U+1FAF
REPLACEMENT = "\ufffd"  # what decoding yields for bytes that are not (yet) a whole character
# The named special tokens a template sees as variables (transformers' special_tokens_map)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")


class NoTokenizer(ValueError):
    """The model dir has no tokenizer.json."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_eos_ids(model_dir: Path) -> set[int]:
    """The eos_token_id of config.json and of generation_config.json, each an id or a list of
    ids (Gemma's generation_config.json: <eos> and <end_of_turn>); a file or key that is
    missing or null names none."""
    ids: set[int] = set()
    for path in (model_dir / "config.json", model_dir / "generation_config.json"):
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        value = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
        named = value if isinstance(value, list) else [] if value is None else [value]
        if not all(type(t) is int for t in named):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of token ids, "
                             f"got {value!r}")
        ids.update(named)
    return ids


@dataclass
class TextCodec:
    """A checkpoint's tokenizer, chat template and the ids that end its answers."""

    tokenizer: Any  # tokenizers.Tokenizer (the library ships no type hints)
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None
    # every named special token tokenizer_config.json gives (bos_token, pad_token, ...)
    special_tokens: dict[str, str] = field(default_factory=dict)
    # the ids that end generation, as transformers' generate and vLLM stop: eos_token_id and
    # the eos_token_id (an id or a list) of config.json and of generation_config.json
    eos_token_ids: frozenset[int] = frozenset()

    @classmethod
    def load(cls, model_dir: Path) -> TextCodec:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise NoTokenizer(f"{model_dir} has no tokenizer.json; give token ids instead of "
                              f"text, or use a checkpoint with a tokenizer (`loractl "
                              f"make-example` writes one)")
        tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        jinja = model_dir / "chat_template.jinja"  # where transformers 5 writes it
        if template is None and jinja.is_file():
            template = jinja.read_text()
        eos = _token_text(cfg.get("eos_token"))
        eos_id = None if eos is None else tok.token_to_id(eos)
        named = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(cfg.get(k))) is not None}
        return cls(tokenizer=tok, chat_template=template if isinstance(template, str) else None,
                   bos_token=_token_text(cfg.get("bos_token")), eos_token=eos,
                   eos_token_id=eos_id, special_tokens=named,
                   eos_token_ids=frozenset(_config_eos_ids(model_dir)
                                           | ({eos_id} if eos_id is not None else set())))

    def encode(self, text: str, *, release_gil: bool = False) -> list[int]:
        return self._ids(text, special=True, release_gil=release_gil)

    def _ids(self, text: str, *, special: bool, release_gil: bool) -> list[int]:
        """`release_gil`: through `encode_batch`, which every `tokenizers` release runs with
        the GIL released (`encode` does only in recent ones), for a long text tokenized on a
        thread beside an event loop."""
        if release_gil:
            return list(self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def max_chars_per_token(self) -> int:
        """The most characters of a text that one token can stand for, so that a text of C
        characters is at least C / this many tokens whatever it holds: the longest token's
        string in the vocabulary (a byte-level BPE's holds a character per byte, so never
        fewer than it decodes to; SentencePiece's as many as it decodes to; a byte-fallback
        token's six, for one byte), times COMPOSED_CHARS where a normalizer runs first
        (NFC and NFKC compose up to 4 characters into one: omega and three marks). A normalizer
        that deletes characters (BERT's control-character cleaning; no chat model's) is not
        allowed for."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        longest = max((len(t) for t in vocab), default=1) or 1
        return longest * (1 if self.tokenizer.normalizer is None else COMPOSED_CHARS)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        """One token's own text, a special token's too (what logprobs name a token by)."""
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a chat, as apply_chat_template(tokenize=False) renders it."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json "
                             "chat_template); use /v1/completions with a prompt instead")
        # what apply_chat_template passes: the named special tokens, the tools (OpenAI's
        # {"type": "function", "function": ...} objects), no documents, and each message
        # without its None-valued keys
        tokens = {**self.special_tokens, **{k: v for k, v in (("bos_token", self.bos_token),
                                                             ("eos_token", self.eos_token)) if v is not None}}
        return str(_compile(self.chat_template).render(
            messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
            tools=tools or None, documents=None, add_generation_prompt=add_generation_prompt, **tokens))

    def encode_chat(self, messages: list[dict[str, Any]], *, release_gil: bool = False,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a rendered chat; the template writes its own special tokens."""
        return self._ids(self.render_chat(messages, tools=tools), special=False,
                         release_gil=release_gil)

    def decode_all(self, ids: Sequence[int]) -> str:
        """The text of `ids` with special tokens kept (a tool-call marker may be one)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """A chat template compiled in the environment transformers' apply_chat_template compiles it
    in (transformers/utils/chat_template_utils.py): a sandbox with trim_blocks, lstrip_blocks
    and loop controls (break, continue); `{% generation %}` blocks (which mark the assistant's
    text for training masks) rendered as their contents; tojson without HTML escaping; and the
    globals raise_exception, strftime_now, dict and a namespace that refuses _-names."""
    import json as _json
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return _json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                           sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:  # dict(...) and dict.fromkeys(...), nothing else of the type
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store _-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=Namespace)
    return env.from_string(template)


class StopStrings:
    """A request's stop strings and the one rule for cutting text at them (the gateway's
    unstreamed answer, its streamed pieces and its early cancel all cut here): the text ends
    where the first stop string to occur in it begins. While text streams, an end of it that
    may still become a stop string is held back until the next token says otherwise."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)

    def cut(self, text: str, start: int = 0) -> int:
        """Where `text` ends: the index at which the first stop string found from `start`
        begins, or len(text) when none is."""
        return min([i for i in (text.find(s, start) for s in self.stops) if i >= 0],
                   default=len(text))

    def ends_one(self, text: str, checked: int) -> bool:
        """Whether a stop string ends in `text` past its first `checked` characters (text
        that held none when it was that long): only its tail is searched."""
        return self.cut(text, max(0, checked - self.longest + 1)) < len(text)

    def releasable(self, text: str, sent: int) -> int:
        """How far streamed `text` may be released, `sent` characters of it released
        already (they hold no stop string, nor the start of one: the search starts past
        them): to where a stop string begins, and short of an end that may still begin one."""
        return min(self.cut(text, sent), len(text) - self._held(text))

    def _held(self, text: str) -> int:
        """The longest end of `text` that begins a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)


class IncrementalDecoder:
    """Text of a growing token sequence, piece by piece: a piece is released only once its
    characters are whole, so a multi-byte character split over tokens is never cut.

    Each push decodes a short window, not the whole sequence (which made a long answer's
    detokenizing quadratic: a 2,000-token answer decoded 2,000 ids per token). The window
    starts one released piece back (`prefix`), and the new piece is what the window's text
    has past the text of its released part (`prefix` to `read`): a decoder that treats a
    sequence's first token differently (SentencePiece's Metaspace drops its leading space)
    does so in both decodes, so it cancels out, as in vLLM's and TGI's detokenizers."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.sent = ""  # the text released so far
        self.unsent = ""  # the text past it that an incomplete character holds back (no U+FFFD)
        self.prefix = 0  # where the window starts
        self.read = 0  # ids[:read] are released

    def push(self, token: int) -> str:
        """The new text that `token` completes ("" while a character is still partial)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left at the end (a character the output never completed decodes as
        U+FFFD, as a whole decode would show it)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self.codec.decode(self.ids[self.prefix:])
        done = self.codec.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix \
            else ""
        if not window.startswith(done):
            self.unsent = ""
            return ""
        piece = window[len(done):]
        if not final and piece.endswith(REPLACEMENT):
            self.unsent = piece.rstrip(REPLACEMENT)
            return ""
        self.sent += piece
        self.unsent = ""
        self.prefix, self.read = self.read, len(self.ids)
        return piece
