"""The sampling parameters users send (computed/serving/sampling.py, applied in the engine's
`sample`) against a dense numpy reference written from their definitions (vLLM's and HF's):
logit_bias, min_tokens, repetition/frequency/presence penalties, top_k, min_p, then top_p; each
alone and all together, over a generated output whose counts the row keeps incrementally."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from computed.serving.engine import sample
from computed.serving.sampling import OFF, Shaping
from shared.replica_protocol import GENERATE_DEFAULTS

VOCAB = 4096


def args_of(**over: Any) -> dict[str, Any]:
    args = {**GENERATE_DEFAULTS, "input_ids": [5, 9, 9, 17, 4000], "max_new_tokens": 24,
            "stop_token_ids": [3, 7]}
    args.update(over)
    return args


def reference(raw: np.ndarray, args: dict[str, Any], output: list[int],
              rng: np.random.Generator) -> int:
    """Every parameter from its definition over the whole vocabulary, recounted from scratch."""
    x = raw.astype(np.float64)
    for token, bias in args["logit_bias"]:
        x[token] += bias
    if len(output) < args["min_tokens"]:
        x[args["stop_token_ids"]] = -np.inf
    rp = args["repetition_penalty"]
    if rp != 1.0:
        seen = np.zeros(len(x), bool)
        seen[args["input_ids"]] = True
        seen[output] = True
        x[seen] = np.where(x[seen] > 0, x[seen] / rp, x[seen] * rp)
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x)).astype(np.float64)
    x -= args["frequency_penalty"] * counts + args["presence_penalty"] * (counts > 0)
    if args["temperature"] == 0.0:
        return int(np.argmax(x))
    z = x / args["temperature"]
    if args["top_k"] > 0:
        kth = np.sort(z)[::-1][args["top_k"] - 1]
        z[z < kth] = -np.inf
    if args["min_p"] > 0:
        p = np.exp(z - z.max())
        p /= p.sum()
        z[p < args["min_p"] * p.max()] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    if args["top_p"] >= 1.0:  # the inverse of the cumulative distribution, in id order
        cdf = np.cumsum(p)
        return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))
    order = np.argsort(-p, kind="stable")
    kept = order[np.cumsum(p[order]) - p[order] < args["top_p"]]
    q = p[kept] / p[kept].sum()
    return int(kept[rng.choice(len(kept), p=q)])


def run_row(args: dict[str, Any], steps: int, seed: int, *, ref: bool) -> list[int]:
    """A row's tokens over `steps` steps of logits that favour what it already produced (so the
    penalties matter), sampled by the engine's `sample` or by the reference."""
    gen = np.random.default_rng(1000 + seed)
    rng = np.random.default_rng(seed)
    shaping = None if ref else Shaping.of(args)
    output: list[int] = []
    for _ in range(steps):
        raw = (gen.standard_normal(VOCAB) * 2.0).astype(np.float32)
        raw[output] += 3.0
        raw[args["stop_token_ids"]] += 6.0  # stop tokens would win without min_tokens
        if ref:
            token = reference(raw, args, output, rng)
        else:
            token = sample(raw, args["temperature"], args["top_p"], rng, shaping)
            if shaping is not None:
                shaping.push(token)
        output.append(token)
    return output


CASES = {
    "logit_bias": {"logit_bias": [[11, 100.0], [12, -100.0], [40, 3.5]]},
    "min_tokens": {"min_tokens": 10},
    "repetition": {"repetition_penalty": 1.7},
    "repetition_below_one": {"repetition_penalty": 0.6},
    "frequency": {"frequency_penalty": 1.5},
    "presence": {"presence_penalty": -1.2},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.2},
    "all": {"top_k": 40, "min_p": 0.05, "presence_penalty": 0.4, "frequency_penalty": 0.3,
            "repetition_penalty": 1.2, "logit_bias": [[100, 2.0]], "min_tokens": 4},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_each_parameter_equals_its_definition(case: str, temperature: float, top_p: float) -> None:
    args = args_of(temperature=temperature, top_p=top_p, **CASES[case])
    assert Shaping.of(args) is not None
    for seed in range(3):
        got = run_row(args, 20, seed, ref=False)
        assert got == run_row(args, 20, seed, ref=True), (case, seed)


def test_each_parameter_changes_what_is_sampled() -> None:
    """The reference is not vacuous: every case samples otherwise than no parameter does."""
    plain = [run_row(args_of(temperature=1.0), 20, s, ref=True) for s in range(3)]
    for case, over in CASES.items():
        shaped = [run_row(args_of(temperature=1.0, **over), 20, s, ref=True) for s in range(3)]
        assert shaped != plain, case


def test_min_tokens_holds_back_the_stop_tokens_then_lets_them_win() -> None:
    args = args_of(min_tokens=6)
    out = run_row(args, 12, 0, ref=False)
    assert not set(out[:6]) & {3, 7}
    assert out[6] in (3, 7)  # greedy: a stop token's +6 wins once allowed


def test_the_same_seed_gives_the_same_tokens() -> None:
    args = args_of(temperature=1.0, **CASES["all"])
    assert run_row(args, 20, 4, ref=False) == run_row(args, 20, 4, ref=False)
    assert run_row(args, 20, 4, ref=False) != run_row(args, 20, 5, ref=False)


def test_rows_without_parameters_keep_the_fast_path() -> None:
    """The defaults are no shaping at all, and `sample` without one is the old sampler (its own
    tests are tests/unit/test_sampler.py): a shaping whose parameters are inert draws the same."""
    assert Shaping.of(args_of()) is None
    assert all(GENERATE_DEFAULTS[k] == v for k, v in OFF.items())
    inert = args_of(temperature=1.0, top_k=VOCAB)
    assert Shaping.of(inert) is not None
    for seed in range(4):
        assert run_row(inert, 16, seed, ref=False) == run_row(args_of(temperature=1.0), 16, seed,
                                                               ref=False)


def test_forked_rows_keep_their_own_counts() -> None:
    first = Shaping.of(args_of(frequency_penalty=1.0, repetition_penalty=1.3))
    assert first is not None
    second = first.fork()
    for t in (20, 20, 21):
        first.push(t)
    second.push(30)
    raw = np.zeros(VOCAB, np.float32)
    raw[[20, 21, 30]] = 1.0
    a, b = first.logits(raw), second.logits(raw)
    assert a[20] == pytest.approx(1 / 1.3 - 2.0) and a[30] == 1.0
    assert b[30] == pytest.approx(1 / 1.3 - 1.0) and b[20] == 1.0
