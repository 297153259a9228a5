"""The example model's tokenizer: a byte-level BPE trained here, written as HF checkpoints
carry it (tokenizer.json, tokenizer_config.json with a chat template, special_tokens_map.json).

Trained on corpus.txt beside this file (text that ships with the repository), so the same
vocab size gives byte-identical files. Byte-level: every byte has a token, so any text
round-trips. Ids 0, 1, 2 are <unk>, <s> and </s>, the config's bos and eos ids.
"""
from __future__ import annotations

import json
from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.txt")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the example config's bos 1, eos 2
MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # the specials and one token per byte
# A chat template in the form transformers' apply_chat_template renders (jinja2, with
# bos_token, eos_token, messages and add_generation_prompt).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def tokenizer_config(max_len: int) -> dict[str, object]:
    """The tokenizer_config.json of the example tokenizer."""
    return {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)},
        "bos_token": "<s>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }


def write_tokenizer(dir: Path, *, vocab_size: int, max_len: int) -> None:
    """Train on corpus.txt and write the tokenizer files into dir; at most vocab_size tokens
    (fewer when the corpus has no more merges to learn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"a byte-level tokenizer needs a vocab of at least {MIN_VOCAB} "
                         f"(3 special tokens and 256 bytes); the model has {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(True),
                            trainer=trainer)
    dir = Path(dir)
    tok.save(str(dir / "tokenizer.json"))
    (dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(max_len), indent=2, sort_keys=True) + "\n")
    (dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2) + "\n")
