"""Token logprobs from the model's own distribution: log_softmax of the raw logits, before any
temperature, penalty or mask, as vLLM reports them by default (docs/gateway.md "logprobs").

A decode step's logits (and a prompt's last position's) are on the host already: `scored` scores
one row there, only for the rows that asked (`Engine._emit`). A prompt's other positions are
scored on the device from prefill's hidden states (computed/model/scores.py).
"""
from __future__ import annotations

import numpy as np

from shared.replica_protocol import TokenScores


def from_logits(logits: np.ndarray, k: int) -> tuple[float, np.ndarray, np.ndarray]:
    """(logsumexp, top k ids, their logprobs) of one row of raw logits, in float64; a token's
    logprob is then `logits[t] - logsumexp`. The top k by descending logprob, ties by id."""
    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    if k == 0:
        return lse, np.zeros(0, np.int64), np.zeros(0)
    top = np.argpartition(-x, k - 1)[:k] if k < x.size else np.arange(x.size)
    top = top[np.lexsort((top, -x[top]))]
    return lse, top, x[top] - lse


def scored(logits: np.ndarray, token: int, k: int) -> TokenScores:
    """`token`'s scores under one row of raw logits (the token sampled from them)."""
    lse, ids, lps = from_logits(logits, k)
    return {"logprob": float(logits[token]) - lse, "top_ids": [int(t) for t in ids],
            "top_logprobs": [float(v) for v in lps]}
