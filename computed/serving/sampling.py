"""A row's sampling parameters beyond temperature and top-p, as vLLM defines them, and the state
they need (docs/protocol.md `generate` args; the engine's `sample` applies them).

In `sample`'s order, on the step's logits (float64):

1. `logit_bias`: each (token, bias) pair's bias added to its logit (greedy sees it too);
2. `min_tokens`: until the row has that many output tokens its stop tokens (`stop_token_ids`,
   which the gateway fills with the model's eos ids) are at -inf;
3. `repetition_penalty` r (HF's and vLLM's): every token seen in the prompt or the output so far
   has its logit divided by r where positive, multiplied by r where not;
4. `frequency_penalty` f and `presence_penalty` p (OpenAI's): each token's logit less f x its
   count in the output so far, less p where that count is above 0 (the prompt does not count);

then greedy takes the argmax; else, after the temperature:

5. `top_k` k: tokens below the k-th largest logit are dropped (every tie with it is kept);
6. `min_p` m: tokens whose probability is below m x the largest probability are dropped;
7. `top_p`, over what is left (renormalised), and the draw (engine.py `sample`), among the
   tokens steps 5-6 kept alone: their dropped tokens' zero probabilities would all tie at the
   nucleus's candidate threshold and send `sample` to a sort of the whole vocabulary.

A row that sends none of them has no `Shaping` (None) and `sample` runs as before, bit for bit.
The penalties' counts are kept incrementally: one token in per step (`push`), and a step costs
O(distinct tokens seen), never a pass over the whole output or a vocabulary-sized array.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

# `generate` args whose defaults mean "off" (shared/replica_protocol.py GENERATE_DEFAULTS)
OFF: dict[str, Any] = {"top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                       "repetition_penalty": 1.0, "logit_bias": [], "min_tokens": 0}


class Shaping:
    """One row's parameters of the list above and its token counts. `fork` gives another row of
    the same request (n > 1) its own counts."""

    def __init__(self, args: Mapping[str, Any]) -> None:
        self.top_k = int(args["top_k"])
        self.min_p = float(args["min_p"])
        self.presence = float(args["presence_penalty"])
        self.frequency = float(args["frequency_penalty"])
        self.repetition = float(args["repetition_penalty"])
        pairs = args["logit_bias"]
        self.bias_ids = np.array([int(t) for t, _ in pairs], np.int64)
        self.bias = np.array([float(b) for _, b in pairs], np.float64)
        self.min_tokens = int(args["min_tokens"])
        self.stops = np.array(sorted(set(args["stop_token_ids"])), np.int64)
        self.penalised = self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0
        self.produced = 0  # output tokens so far
        # the tokens the penalties touch: the prompt's (for repetition) then each new output
        # token, in `ids[:used]`, with their output counts; `index` finds a token's entry
        prompt = np.unique(np.asarray(args["input_ids"], np.int64)) if self.repetition != 1.0 \
            else np.zeros(0, np.int64)
        room = len(prompt) + int(args["max_new_tokens"])
        self.ids = np.zeros(room, np.int64)
        self.ids[:len(prompt)] = prompt
        self.counts = np.zeros(room, np.float64)
        self.used = len(prompt)
        self.index = {int(t): i for i, t in enumerate(prompt)}

    @staticmethod
    def of(args: Mapping[str, Any]) -> Shaping | None:
        """The row's shaping, None when `args` use none of these parameters (the fast path)."""
        if all(args[k] == v for k, v in OFF.items()):
            return None
        return Shaping(args)

    def fork(self) -> Shaping:
        """A fresh copy for another choice of the same request, before either has an output."""
        other = object.__new__(Shaping)
        other.__dict__.update(self.__dict__)
        other.ids, other.counts, other.index = self.ids.copy(), self.counts.copy(), dict(self.index)
        return other

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.min_p > 0.0

    def logits(self, raw: np.ndarray) -> np.ndarray:
        """Steps 1-4 on a float64 copy of `raw`."""
        x = raw.astype(np.float64)
        if self.bias_ids.size:
            np.add.at(x, self.bias_ids, self.bias)
        if self.produced < self.min_tokens and self.stops.size:
            x[self.stops] = -np.inf
        if self.penalised and self.used:
            ids, counts = self.ids[:self.used], self.counts[:self.used]
            if self.repetition != 1.0:
                seen = x[ids]
                x[ids] = np.where(seen > 0, seen / self.repetition, seen * self.repetition)
            if self.frequency != 0.0 or self.presence != 0.0:
                x[ids] -= self.frequency * counts + self.presence * (counts > 0)
        return x

    def truncate(self, z: np.ndarray) -> np.ndarray:
        """Steps 5-6 on tempered logits `z`, in place: dropped tokens at -inf."""
        n = len(z)
        if 0 < self.top_k < n:
            kth = np.partition(z, n - self.top_k)[n - self.top_k]
            z[z < kth] = -np.inf
        if self.min_p > 0.0:
            p = np.exp(z - z.max())
            p /= p.sum()
            z[p < self.min_p * p.max()] = -np.inf
        return z

    def push(self, token: int) -> None:
        """The row's new output token, into its counts."""
        self.produced += 1
        if not self.penalised:
            return
        i = self.index.get(token)
        if i is None:
            i = self.index[token] = self.used
            self.ids[i] = token
            self.used += 1
        self.counts[i] += 1.0
