"""Prompt logprobs on the device (the host side of logprobs: computed/serving/logprobs.py).

A prompt's logprobs (`echo` with `logprobs`) come from the prefill forward's final normed hidden
states, which prefill and extend return beside the last logits (computed/model/decoder.py):
`score_jit` computes the LM head, log_softmax, the target token's logprob and the top `MAX_TOP`
for `SCORE_ROWS` positions at once. It has one shape, compiled at warm-up
(computed/model/warmup.py); `prompt_scores` feeds it the asked positions in chunks of that
size, padded.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from computed.model.decoder import logits_of
from computed.model.params import DecoderParams
from shared.replica_protocol import MAX_TOP, TokenScores

SCORE_ROWS = 64  # positions one `score_jit` call scores (its one compiled shape)


def _score(params: DecoderParams, h: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For `h [SCORE_ROWS, hidden]` (final normed hidden states): the logprob of `targets[i]` at
    row i, and each row's top MAX_TOP (ids, logprobs)."""
    lp = jax.nn.log_softmax(logits_of(params, h), axis=-1)
    chosen = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    top_lps, top_ids = jax.lax.top_k(lp, MAX_TOP)
    return chosen, top_ids, top_lps


score_jit = jax.jit(_score)


def lower_score(params: DecoderParams, hidden_dtype: Any) -> Any:
    """`score_jit` compiled for its one shape (the warm-up's job)."""
    h = jax.ShapeDtypeStruct((SCORE_ROWS, params.config.hidden_size), hidden_dtype)
    return score_jit.lower(params, h, jax.ShapeDtypeStruct((SCORE_ROWS,), jnp.int32)).compile()


def prompt_scores(params: DecoderParams, hidden: np.ndarray, targets: np.ndarray, k: int) -> list[TokenScores]:
    """Scores of `targets[i]` after hidden state `hidden[i]` (one per asked prompt position, on the
    host), in calls of SCORE_ROWS rows (the last padded with row 0)."""
    out: list[TokenScores] = []
    for at in range(0, len(targets), SCORE_ROWS):
        part = slice(at, min(at + SCORE_ROWS, len(targets)))
        n = part.stop - part.start
        h = np.zeros((SCORE_ROWS, hidden.shape[1]), hidden.dtype)
        t = np.zeros(SCORE_ROWS, np.int32)
        h[:n], t[:n] = hidden[part], targets[part]
        chosen, ids, lps = (np.asarray(a) for a in score_jit(params, h, t))
        out += [{"logprob": float(chosen[i]), "top_ids": ids[i, :k].tolist(),
                 "top_logprobs": lps[i, :k].astype(np.float64).tolist()} for i in range(n)]
    return out
