"""The example tokenizer (trained by `loractl make-example`) and shared/text.py: text
round-trips, the chat template renders as transformers renders it, and incremental
detokenization never releases part of a multi-byte character."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.text import REPLACEMENT, IncrementalDecoder, TextCodec
from statesvc.tools.example import ExampleAssets, ModelShape, make_example

TEXTS = ["Hello, world!", "Grüße aus München — 日本語のテキスト 🎉🚀", "  spaces\tand\nnewlines ",
         "\x00\x7f control bytes", "<s> is special, </s> too"]


def test_text_round_trips_within_the_model_vocab(example: ExampleAssets) -> None:
    codec = TextCodec.load(example.model_dir)
    assert codec.tokenizer.get_vocab_size() <= example.shape.vocab_size
    assert (codec.bos_token, codec.eos_token, codec.eos_token_id) == ("<s>", "</s>", 2)
    for text in TEXTS[:4]:
        ids = codec.encode(text)
        assert max(ids) < example.shape.vocab_size
        assert codec.decode(ids) == text


def test_the_same_vocab_gives_byte_identical_files(tmp_path: Path,
                                                  example: ExampleAssets) -> None:
    again = make_example(tmp_path / "again", seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again.model_dir / name).read_bytes() == (example.model_dir / name).read_bytes()


def test_eos_ids_are_the_tokenizers_and_every_configs(tmp_path: Path) -> None:
    """As transformers' generate and vLLM stop: the tokenizer's eos, and the eos_token_id of
    config.json and generation_config.json, each an id or a list (Gemma's example lists
    <eos> and <end_of_turn>)."""
    gemma = make_example(tmp_path / "gemma", family="gemma2", adapters=())
    model = gemma.model_dir
    codec = TextCodec.load(model)
    end_of_turn = codec.tokenizer.token_to_id("<end_of_turn>")
    assert codec.eos_token_ids == {codec.eos_token_id, end_of_turn} == {1, 5}
    gen, cfg = model / "generation_config.json", model / "config.json"
    config = json.loads(cfg.read_text())
    for config_eos, gen_eos, want in ((1, None, {1}), ([1, 40], 7, {1, 7, 40}),
                                      (None, [9, 1], {1, 9}), (None, None, {1})):
        cfg.write_text(json.dumps({**config, "eos_token_id": config_eos}))
        gen.write_text(json.dumps({"eos_token_id": gen_eos}))
        assert TextCodec.load(model).eos_token_ids == want, (config_eos, gen_eos)
    gen.unlink()  # a checkpoint without generation_config.json
    assert TextCodec.load(model).eos_token_ids == {1}
    for bad in ("1", [1, "2"], [1.0], True, {"id": 1}):
        gen.write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a "
                                             "token id or a list of token ids"):
            TextCodec.load(model)


def test_a_vocab_without_room_for_bytes_gets_no_tokenizer(tmp_path: Path) -> None:
    small = make_example(tmp_path / "small", shape=ModelShape(vocab_size=256), adapters=())
    assert not (small.model_dir / "tokenizer.json").exists()


def test_incremental_pieces_are_whole_characters(example: ExampleAssets) -> None:
    codec = TextCodec.load(example.model_dir)
    for text in TEXTS[:4]:
        dec = IncrementalDecoder(codec)
        pieces = [dec.push(t) for t in codec.encode(text)]
        assert all(REPLACEMENT not in p for p in pieces)
        assert "".join(pieces) + dec.flush() == text
    # bytes that never complete a character come out at the end, as a whole decode shows them
    dec = IncrementalDecoder(codec)
    emoji = codec.encode("🎉")
    pieces = [dec.push(t) for t in emoji[:-1]]
    assert "".join(pieces) + dec.flush() == codec.decode(emoji[:-1])


def test_chat_template_renders_as_transformers(example: ExampleAssets) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(example.model_dir))
    codec = TextCodec.load(example.model_dir)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Grüße 🎉"}]
    assert codec.render_chat(messages) == tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert codec.encode_chat(messages) == tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert codec.encode_chat(messages, release_gil=True) == codec.encode_chat(messages)
    for text in TEXTS:
        assert codec.encode(text) == tok(text).input_ids
        assert codec.encode(text, release_gil=True) == tok(text).input_ids  # encode_batch


def test_incremental_pieces_keep_a_metaspace_decoders_spaces() -> None:
    """A SentencePiece-style decoder drops the leading space of a sequence's first token:
    pieces decoded from a window keep every space a whole decode has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    words = ["▁Hello", "▁world", "!", "▁Grüße", "▁🎉", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    codec = TextCodec(tokenizer=tok, chat_template=None, bos_token=None, eos_token=None,
                      eos_token_id=None)
    ids = [0, 1, 2, 3, 4, 1, 2, 2]
    whole = codec.decode(ids)
    assert whole == "Hello world! Grüße 🎉 world!!"
    dec = IncrementalDecoder(codec)
    pieces = [dec.push(t) for t in ids]
    assert "".join(pieces) + dec.flush() == whole == dec.sent
    assert pieces[1] == " world"
