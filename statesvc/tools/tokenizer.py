"""The example model's tokenizer: a byte-level BPE trained here, written as HF checkpoints
carry it (tokenizer.json, tokenizer_config.json with a chat template, special_tokens_map.json).

Trained on corpus.txt beside this file (text that ships with the repository), so the same
vocab size gives byte-identical files. Byte-level: every byte has a token, so any text
round-trips. Each family (`TOKENIZERS`) has its own special tokens (ids 0, 1, ... in the
order given, before the bytes), the roles they play (bos, eos, pad, unk), the tokens besides
eos that end an answer (generation_config.json's eos_token_id list) and its chat template,
written here in the form that family's tokenizer_config.json carries it (jinja2, rendered by
transformers' apply_chat_template and by shared/text.py), reduced to what the gateway sends
(each message's role and text content, tools and tool calls where the family has a tool
format: Qwen's Hermes-style <tool_call>, Llama 3.1's JSON, Mistral's [TOOL_CALLS]; no images). Llama's are <unk>, <s>, </s> at
ids 0, 1, 2, the example config's bos 1 and eos 2.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).with_name("corpus.txt")

# Llama's: a header per role (<|user|>, ...) and eos after each turn, in the form
# transformers' apply_chat_template renders (jinja2, with bos_token, eos_token, messages,
# tools and add_generation_prompt); with Llama 3.1's tool calls (its JSON format): the tools go
# in front of the first user turn, a call is {"name", "parameters"}, a result an `ipython` turn.
LLAMA_TEMPLATE = """\
{{- bos_token }}
{%- set ns = namespace(told=false) %}
{%- for message in messages %}
{%- if message['role'] == 'user' and tools and not ns.told %}
{%- set ns.told = true %}
{{- '<|user|>\\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
{%- for tool in tools %}
{{- tool | tojson(indent=4) + '\\n\\n' }}
{%- endfor %}
{{- message['content'] + eos_token + '\\n' }}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{%- for call in message['tool_calls'] %}
{%- set call = call['function'] if call['function'] is defined else call %}
{{- '<|assistant|>\\n{"name": "' + call['name'] + '", "parameters": ' + call['arguments'] | tojson + '}' + eos_token + '\\n' }}
{%- endfor %}
{%- elif message['role'] == 'tool' %}
{{- '<|ipython|>\\n' + (message['content'] if message['content'] is string else message['content'] | tojson) + eos_token + '\\n' }}
{%- else %}
{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>\\n' }}
{%- endif %}
"""

# Qwen2.5's and Qwen3's tools (Hermes-style, as their templates write them): the signatures in
# the system turn, each call in <tool_call> tags, the results in a user turn's <tool_response>s
_HERMES_TOOLS = """\
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}
{{- "\\n" + tool | tojson }}
{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
"""
_HERMES_TURNS = """\
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{{- '<|im_start|>assistant' + ('\\n' + message['content'] if message['content'] else '') }}
{%- for call in message['tool_calls'] %}
{%- set call = call['function'] if call['function'] is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + call['name'] + '", "arguments": ' + call['arguments'] | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
"""

# ChatML as Qwen2.5 writes it: a system turn always, the default one when the chat has none.
QWEN2_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] + '\\n\\n' }}
{%- else %}
{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' + '\\n\\n' }}
{%- endif %}
""" + _HERMES_TOOLS + """{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
""" + _HERMES_TURNS + """{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# ChatML as Qwen3 writes it: no default system turn; an assistant turn's <think> block is kept
# only after the last user turn (earlier turns keep their answer alone).
QWEN3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] + '\\n\\n' }}
{%- endif %}
""" + _HERMES_TOOLS + """{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}
{%- set ns.last_user = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message['content'] %}
{%- if message['role'] == 'system' and loop.first and tools %}
""" + _HERMES_TURNS + """{%- elif message['role'] == 'assistant' %}
{%- set reasoning = '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_user and reasoning %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Gemma 2: turns of `user` and `model` that must alternate, starting with the user; no system role.
GEMMA2_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{{- raise_exception('System role not supported') }}
{%- endif %}
{%- for message in messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

# Gemma 3: Gemma 2's turns; a leading system message is put at the start of the first user turn.
GEMMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- set prefix = messages[0]['content'] + '\\n\\n' %}
{%- set turns = messages[1:] %}
{%- else %}
{%- set prefix = '' %}
{%- set turns = messages %}
{%- endif %}
{%- for message in turns %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

# Mistral: [INST] ... [/INST] around each user turn, the answer after it closed by </s>; user
# and assistant alternate, and a leading system message goes in front of the last user turn.
MISTRAL_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
{%- set system = messages[0]['content'] %}
{%- set turns = messages[1:] %}
{%- else %}
{%- set system = none %}
{%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- set ns = namespace(turn=0, last_user=-1) %}
{%- for message in turns %}
{%- if message['role'] == 'user' %}
{%- set ns.last_user = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for message in turns %}
{%- if message['role'] == 'user' or (message['role'] == 'assistant' and not message['tool_calls']) %}
{%- if (message['role'] == 'user') != (ns.turn % 2 == 0) %}
{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- set ns.turn = ns.turn + 1 %}
{%- endif %}
{%- if message['role'] == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}
{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- if loop.last and system is not none %}
{{- '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}
{%- else %}
{{- '[INST] ' + message['content'] + ' [/INST]' }}
{%- endif %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message['tool_calls'] %}
{%- set call = call['function'] if call['function'] is defined else call %}
{{- '{"name": "' + call['name'] + '", "arguments": ' + call['arguments'] | tojson + '}' + ('' if loop.last else ', ') }}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message['role'] == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + message['content'] | tojson + '}[/TOOL_RESULTS]' }}
{%- elif message['role'] == 'assistant' %}
{{- ' ' + message['content'] + eos_token }}
{%- else %}
{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
{%- endif %}
{%- endfor %}
"""

# OLMo 2 (Tulu's format): <|system|>, <|user|> and <|assistant|> headers, answers closed by eos.
OLMO2_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message['role'] == 'system' or message['role'] == 'user' %}
{{- '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|assistant|>\\n' + message['content'] + eos_token + ('' if loop.last else '\\n') }}
{%- endif %}
{%- if loop.last and add_generation_prompt %}
{{- '<|assistant|>\\n' }}
{%- endif %}
{%- endfor %}
"""

# Granite 3: role headers between <|start_of_role|> and <|end_of_role|>; without a system
# message, a default one that carries today's date (transformers' strftime_now).
GRANITE_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
{%- set system = messages[0]['content'] %}
{%- set turns = messages[1:] %}
{%- else %}
{%- set system = "Knowledge Cutoff Date: April 2024.\\nToday's Date: " + strftime_now('%B %d, %Y') + ".\\nYou are Granite, developed by IBM." %}
{%- set turns = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system + '<|end_of_text|>\\n' }}
{%- for message in turns %}
{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_of_role|>assistant<|end_of_role|>' }}
{%- endif %}
"""

# The named roles a special token can play, as tokenizer_config.json names them.
ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
# How Qwen's tokenizer.json splits text before its byte-level BPE (after NFC): letters, single
# digits, punctuation runs, newlines and other spaces apart, as GPT-4's tokenizer does.
# transformers 5 loads a `qwen2` checkpoint's tokenizer as Qwen2Tokenizer, which applies this
# split whatever tokenizer.json says, so the example's tokenizer.json must say it too.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class TokenizerSpec:
    """A family's special tokens (ids 0, 1, ... in this order), the role each named one plays,
    and its chat template."""

    special_tokens: tuple[str, ...]
    chat_template: str
    bos_token: str | None
    eos_token: str
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos: bool = False  # the tokenizer puts bos in front of every text it encodes
    nulls: tuple[str, ...] = ()  # roles tokenizer_config.json gives as null (Qwen's bos and unk)
    split: str | None = None  # a regex splitting NFC text before the byte-level BPE (Qwen's)
    # the tokens besides eos that end an answer: the family's generation_config.json lists them
    # after eos in eos_token_id (Gemma's <end_of_turn>, Qwen's <|endoftext|>)
    also_eos: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for role in ROLES:
            token = getattr(self, role)
            if token is not None and token not in self.special_tokens:
                raise ValueError(f"{role} {token!r} is not one of the special tokens")
        for token in self.also_eos:
            if token not in self.special_tokens or token == self.eos_token:
                raise ValueError(f"also_eos {token!r} is not one of the special tokens other "
                                 f"than eos")
        if self.add_bos and self.bos_token is None:
            raise ValueError("add_bos needs a bos_token")
        if set(self.nulls) - set(ROLES) or any(getattr(self, r) is not None for r in self.nulls):
            raise ValueError(f"nulls must be roles ({', '.join(ROLES)}) the family leaves empty")

    @property
    def min_vocab(self) -> int:
        """The smallest vocab with room for the special tokens and one token per byte."""
        return len(self.special_tokens) + 256

    def token_id(self, role: str) -> int | None:
        """The id of the token playing `role` ("bos_token", ...), None if the family has none."""
        token = getattr(self, role)
        return None if token is None else self.special_tokens.index(token)

    @property
    def eos_ids(self) -> list[int]:
        """The ids that end an answer, eos first, as generation_config.json lists them."""
        return [self.special_tokens.index(t) for t in (self.eos_token, *self.also_eos)]

    @property
    def named(self) -> dict[str, str]:
        """role -> token, for the roles this family fills."""
        return {r: getattr(self, r) for r in ROLES if getattr(self, r) is not None}

    @property
    def extra_special_tokens(self) -> list[str]:
        """The special tokens that play no named role (<|im_start|>, <start_of_turn>, ...)."""
        named = set(self.named.values())
        return [t for t in self.special_tokens if t not in named]


LLAMA = TokenizerSpec(("<unk>", "<s>", "</s>"), LLAMA_TEMPLATE, bos_token="<s>", eos_token="</s>",
                      unk_token="<unk>")
_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_GEMMA = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
_QWEN: dict[str, Any] = dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                             also_eos=("<|endoftext|>",), nulls=("bos_token", "unk_token"),
                             split=QWEN_SPLIT)
TOKENIZERS: dict[str, TokenizerSpec] = {
    "llama": LLAMA,
    "qwen2": TokenizerSpec(_CHATML, QWEN2_TEMPLATE, **_QWEN),
    "qwen3": TokenizerSpec(_CHATML, QWEN3_TEMPLATE, **_QWEN),
    "mistral": TokenizerSpec(("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), MISTRAL_TEMPLATE,
                             bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos=True),
    "gemma2": TokenizerSpec(_GEMMA, GEMMA2_TEMPLATE, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>", unk_token="<unk>", add_bos=True,
                            also_eos=("<end_of_turn>",)),
    "gemma3": TokenizerSpec(_GEMMA, GEMMA3_TEMPLATE, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>", unk_token="<unk>", add_bos=True,
                            also_eos=("<end_of_turn>",)),
    "olmo2": TokenizerSpec(("<|endoftext|>", "<|pad|>"), OLMO2_TEMPLATE, bos_token="<|endoftext|>",
                           eos_token="<|endoftext|>", pad_token="<|pad|>"),
    "granite": TokenizerSpec(("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"),
                             GRANITE_TEMPLATE, bos_token="<|end_of_text|>",
                             eos_token="<|end_of_text|>", pad_token="<|end_of_text|>",
                             unk_token="<|end_of_text|>"),
}

# Llama's, kept as names other modules use
SPECIAL_TOKENS = LLAMA.special_tokens
MIN_VOCAB = LLAMA.min_vocab


def tokenizer_config(max_len: int, spec: TokenizerSpec = LLAMA) -> dict[str, object]:
    """The tokenizer_config.json of the example tokenizer."""
    cfg: dict[str, object] = {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(spec.special_tokens)},
        "chat_template": spec.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
        **spec.named,
        **{role: None for role in spec.nulls},
    }
    if spec.add_bos:
        cfg["add_bos_token"] = True
    if spec.extra_special_tokens:
        cfg["extra_special_tokens"] = spec.extra_special_tokens
    return cfg


def special_tokens_map(spec: TokenizerSpec = LLAMA) -> dict[str, object]:
    """special_tokens_map.json: the named tokens, then the others."""
    out: dict[str, object] = dict(sorted(spec.named.items()))
    if spec.extra_special_tokens:
        out["additional_special_tokens"] = spec.extra_special_tokens
    return out


def write_tokenizer(dir: Path, *, vocab_size: int, max_len: int,
                    spec: TokenizerSpec = LLAMA) -> None:
    """Train on corpus.txt and write the tokenizer files into dir; at most vocab_size tokens
    (fewer when the corpus has no more merges to learn)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if vocab_size < spec.min_vocab:
        raise ValueError(f"a byte-level tokenizer needs a vocab of at least {spec.min_vocab} "
                         f"({len(spec.special_tokens)} special tokens and 256 bytes); the model "
                         f"has {vocab_size}")
    tok = Tokenizer(models.BPE())
    if spec.split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(spec.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    if spec.add_bos:
        assert spec.bos_token is not None
        bos = (spec.bos_token, spec.special_tokens.index(spec.bos_token))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(spec.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(True),
                            trainer=trainer)
    dir = Path(dir)
    tok.save(str(dir / "tokenizer.json"))
    (dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(max_len, spec), indent=2, sort_keys=True) + "\n")
    (dir / "special_tokens_map.json").write_text(
        json.dumps(special_tokens_map(spec), indent=2) + "\n")
