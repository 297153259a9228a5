"""Prefill for the engine: prefix-cache hits, and long prompts in chunks between decode steps.

An admitted request first looks its prompt up in the prefix cache (computed/serving/prefix_cache.py)
under its adapter version's content root: the blocks of its longest cached prefix are copied
into its row, and only the rest of the prompt is computed. It then waits here until its prompt
is in its row. A prompt is computed in pieces of at most `chunk` tokens (--prefill-chunk),
16-token-aligned, each waiting prompt's next piece in one call (Runner.prefill groups them
into forwards by bucket). Each engine step gives prefill a token budget: unlimited while no
request is decoding, else `chunk` tokens, spent on the waiting prompts in admission order (the
first piece of a step is never empty). So a 2,000-token prompt that arrives among running
streams costs each of their steps one chunk, not one whole prompt. Once a prompt is in its row, its blocks not yet
in the store are saved there, and its first token is sampled.

Exactness: the KV of a cached block is the KV the same tokens under the same adapter content
computed; a chunk attends over its row's earlier positions exactly as a whole prompt does.
Greedy outputs with the cache on equal those with it off (tests/integration/test_prefix_cache.py).

Prompt logprobs (`prompt_logprobs`): each piece's forward also hands back the final hidden states
of the positions it computed for such a prompt; once the prompt is whole they are scored
(Runner.score). Such a prompt bypasses the prefix cache, so every position is computed.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from computed.serving.prefix_cache import PrefixCache
from computed.serving.rows import Running
from shared.prefix import BLOCK_TOKENS


class Prefills:
    """The prompts admitted and not yet in their rows, the prefix cache and its store. The model
    is the engine's, with what chunks and the store need besides `Model.prefill`: `prefill`'s
    `starts`, `new_blocks`, `load_blocks` and `save_blocks` (computed/model/runner.py
    Runner, built with `extend`)."""

    def __init__(self, model: Any, *, chunk: int = 0, prefix_blocks: int = 0) -> None:
        if chunk and (chunk % BLOCK_TOKENS or not getattr(model, "extend", False)):
            raise ValueError(f"--prefill-chunk {chunk}: expected a multiple of {BLOCK_TOKENS}, on a model "
                             "built for chunks")
        if prefix_blocks and not getattr(model, "extend", False):
            raise ValueError("the prefix cache needs a model built for chunks (Runner extend=True)")
        self.model = model
        self.chunk = chunk  # tokens a step prefills while others decode; 0: whole prompts
        self.cache = PrefixCache(prefix_blocks) if prefix_blocks else None
        self.store = model.new_blocks(prefix_blocks) if prefix_blocks else None
        self.waiting: list[Running] = []

    def admit(self, run: Running, kv: Any) -> Any:
        """Queue `run`'s prompt; a prefix-cache hit is copied into its row now. Returns the KV cache."""
        prompt = run.req.args["input_ids"]
        # a prompt whose logprobs were asked for bypasses the cache: each of its positions is
        # computed (docs/prefix-cache.md); its blocks are not saved either
        if self.cache is not None and run.req.args["prompt_logprobs"] is None:
            hit = self.cache.lookup(run.grant.root, prompt)
            run.hit = hit
            if hit.ids:
                kv = self.model.load_blocks(kv, self.store, run.row, hit.ids)
                run.prefilled = hit.tokens
        self.waiting.append(run)
        return kv

    def fork(self, run: Running, kv: Any) -> Any:
        """`run`'s prompt, now whole in its row, shared with the other choices of its request (n or
        best_of above 1): its row's KV copied into each of theirs, one jitted copy of a whole row
        each (`Model.copy_row`, compiled at warm-up). The prefix cache is not used for it: it is
        off on some replicas, and a copy costs what a hit of the whole prompt would."""
        for other in (run.group or [run])[1:]:
            kv = self.model.copy_row(kv, run.row, other.row)
            other.prefilled = run.prefilled
        return kv

    def drop(self, run: Running) -> None:
        """`run` leaves (cancelled, failed) before its prompt was in its row."""
        if run in self.waiting:
            self.waiting.remove(run)
        run.hit = None

    def plan(self, budget: int | None) -> list[tuple[Running, int]]:
        """(request, end of its next piece) for the waiting prompts within `budget` tokens (None:
        no limit); a piece is at most `chunk` tokens where chunks are on."""
        out: list[tuple[Running, int]] = []
        if budget is not None and budget <= 0:
            return out
        for run in self.waiting:
            if budget is not None and budget <= 0:  # the first piece may overspend it
                break
            left = len(run.req.args["input_ids"]) - run.prefilled
            if self.chunk and left > self.chunk:
                left = self.chunk
            if budget is not None:
                if left > budget:  # whole blocks within it; the first piece at least one block
                    left = min(left, budget // BLOCK_TOKENS * BLOCK_TOKENS
                               or (BLOCK_TOKENS if not out else 0))
                if not left:
                    break
                budget -= left
            out.append((run, run.prefilled + left))
        return out

    def run(self, pool: Any, kv: Any, budget: int | None) -> tuple[list[tuple[Running, np.ndarray]], Any, int]:
        """Prefill pieces until the waiting prompts are whole in their rows or `budget` tokens are
        spent (None: no limit): returns the requests whose prompts are now whole, with their last
        token's logits, the KV cache and the tokens computed. (Pieces of `chunk` tokens are
        cheaper than one whole long prompt even with nothing to interleave: a whole prompt pads to
        its power-of-two bucket and attends over all of it, docs/prefix-cache.md.)"""
        finished: list[tuple[Running, np.ndarray]] = []
        spent = 0
        while pieces := self.plan(None if budget is None else budget - spent):
            spent += sum(end - r.prefilled for r, end in pieces)
            starts = [r.prefilled for r, _ in pieces]
            # the prompts whose logprobs were asked for get their positions' hidden states
            hidden = {i: np.zeros(0) for i, (r, _) in enumerate(pieces)
                      if r.req.args["prompt_logprobs"] is not None}
            logits, kv = self.model.prefill(
                pool, kv, [r.req.args["input_ids"][:end] for r, end in pieces], [r.row for r, _ in pieces],
                [r.grant.slot for r, _ in pieces], **({"starts": starts} if any(starts) else {}),
                **({"hidden": hidden} if hidden else {}))
            for i, ((run, end), row_logits) in enumerate(zip(pieces, logits)):
                run.prefilled = end
                if i in hidden:
                    run.hidden.append(hidden[i])
                if end == len(run.req.args["input_ids"]):
                    self.waiting.remove(run)
                    kv = self._save(run, kv)
                    if i in hidden:
                        self._score_prompt(run)
                    finished.append((run, row_logits))
        return finished, kv, spent

    def _score_prompt(self, run: Running) -> None:
        """The logprob of each prompt token after the ones before it (the first has none), from
        the hidden states its pieces left (`hidden`)."""
        prompt = run.req.args["input_ids"]
        states, run.hidden = np.concatenate(run.hidden), []
        scores = self.model.score(states[:len(prompt) - 1], prompt[1:], run.req.args["prompt_logprobs"]) \
            if len(prompt) > 1 else []
        run.prompt_scores = [None, *scores]

    def _save(self, run: Running, kv: Any) -> Any:
        hit, run.hit = run.hit, None
        if self.cache is not None and hit is not None:
            src, dst = self.cache.claim(hit)
            if src:
                self.store = self.model.save_blocks(self.store, kv, run.row, src, dst)
        return kv

    def status(self) -> dict[str, Any] | None:
        return None if self.cache is None else self.cache.status()
