"""Text in and out of a checkpoint: its tokenizer.json (the `tokenizers` library), the chat
template of its tokenizer_config.json rendered as transformers' apply_chat_template renders
it, and incremental detokenization that never splits a multi-byte character."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

REPLACEMENT = "\ufffd"  # what decoding yields for bytes that are not (yet) a whole character


class NoTokenizer(ValueError):
    """The model dir has no tokenizer.json."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TextCodec:
    """A checkpoint's tokenizer and chat template."""

    tokenizer: Any  # tokenizers.Tokenizer (the library ships no type hints)
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None

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
        return cls(tokenizer=tok, chat_template=template if isinstance(template, str) else None,
                   bos_token=_token_text(cfg.get("bos_token")), eos_token=eos,
                   eos_token_id=None if eos is None else tok.token_to_id(eos))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: list[dict[str, Any]], *,
                    add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat, as apply_chat_template(tokenize=False) renders it."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json "
                             "chat_template); use /v1/completions with a prompt instead")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a rendered chat; the template writes its own special tokens."""
        return list(self.tokenizer.encode(self.render_chat(messages),
                                          add_special_tokens=False).ids)


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
