"""The gateway's streamed text (gateway/streaming.py `StreamText`): the pieces, one
per token, plus what is left at the end are exactly the whole answer's text; no piece holds
part of a character, a stop token's text or anything from where a stop string begins."""
from __future__ import annotations

import random

from gateway.streaming import StreamText
from shared.text import REPLACEMENT, TextCodec
from statesvc.tools.example import ExampleAssets

TEXTS = ["Grüße aus München — 日本語のテキスト 🎉🚀 and more", "Once upon a time, a time",
         "abababab aab", "🎉🎉🎉 x 🎉"]


def whole(codec: TextCodec, ids: list[int], stop_ids: set[int], stops: list[str]) -> str:
    """The answer's text as the gateway gives it unstreamed (service.Gateway._finish)."""
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    text = codec.decode(ids)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def test_pieces_add_up_to_the_whole_text(example: ExampleAssets) -> None:
    codec = TextCodec.load(example.model_dir)
    rng = random.Random(0)
    eos = codec.eos_token_id
    assert eos is not None
    for text in TEXTS:
        ids = codec.encode(text)
        for trial in range(40):
            n = rng.randint(1, len(ids))
            out = ids[:n] + ([eos] if trial % 3 == 0 else [])
            full = codec.decode(ids[:n])
            stops = [] if trial % 5 == 0 else [
                full[a:a + rng.randint(1, 4)] for a in
                (rng.randrange(max(len(full), 1)) for _ in range(rng.randint(1, 3)))]
            stops = [s for s in stops if s] + ["zzz-never"]
            st = StreamText(codec, {eos}, stops)
            pieces = [st.push(t) for t in out]
            want = whole(codec, out, {eos}, stops)
            sent = "".join(pieces)
            assert want.startswith(sent), (text, n, stops)
            assert sent + st.rest(want) == want
            assert all(REPLACEMENT not in p for p in pieces)
            assert len(pieces) == len(out)


def test_text_that_may_begin_a_stop_string_is_held_back(example: ExampleAssets) -> None:
    codec = TextCodec.load(example.model_dir)
    st = StreamText(codec, set(), ["time,"])
    ids = codec.encode("Once upon a time, a time")
    got = ""
    for t in ids:
        got += st.push(t)
        assert "time" not in got  # never released before it is known not to be "time,"
    assert got == "Once upon a "
    assert st.rest("Once upon a ") == ""


def test_a_stop_string_is_caught_on_the_token_that_completes_it(example: ExampleAssets) -> None:
    """service.StopWatch: how many tokens a request keeps before it is cancelled on its
    replica (the first whose text holds a whole stop string), found from the text's tail."""
    from gateway.service import StopWatch

    codec = TextCodec.load(example.model_dir)
    rng = random.Random(1)
    for text in ("Once upon a time, a time", "abababab aab", "Grüße aus München"):
        ids = codec.encode(text)
        for _ in range(40):
            a = rng.randrange(len(text) - 1)
            stops = [text[a:a + rng.randint(1, 5)], "zzz-never"]
            watch = StopWatch(codec, stops)
            for t in ids:
                watch.push(t)
                if watch.hit is not None:
                    break
            first = next(k for k in range(1, len(ids) + 1)
                         if any(s in codec.decode(ids[:k]) for s in stops))
            assert watch.hit == first, (text, stops)
