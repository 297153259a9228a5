"""Prefills' token budget (computed/serving/prefill.py) as pure logic, over stand-ins: a piece
never runs past its prompt's end, even when what is left of the step's budget is less than a
block (a first piece then takes up to one block); a step's first piece may overspend the budget,
and nothing after it may then be planned (a negative budget once planned pieces of negative
length, and the replica failed on an empty prompt)."""
from __future__ import annotations

import types
from typing import Any

import numpy as np

from computed.serving.prefill import Prefills


class Recording:
    extend = True

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int]]] = []

    def prefill(self, pool: Any, kv: Any, prompts: list[list[int]], rows: list[int], slots: list[int],
                starts: list[int] | None = None) -> tuple[np.ndarray, Any]:
        self.calls.append(([len(p) for p in prompts], list(starts or [0] * len(prompts))))
        return np.zeros((len(prompts), 4), np.float32), kv


def waiting(n: int, prefilled: int, row: int) -> Any:
    req = types.SimpleNamespace(args={"input_ids": list(range(n)), "prompt_logprobs": None})
    return types.SimpleNamespace(req=req, prefilled=prefilled, row=row, hit=None, hidden=[],
                                 grant=types.SimpleNamespace(slot=-1, root="base"))


def test_a_step_budget_overspent_by_its_first_piece_plans_nothing_more() -> None:
    model = Recording()
    prefills = Prefills(model, chunk=16)
    # a 7-token rest leaves 9 of 16; the next prompt's first piece (16, never empty) overspends
    runs = [waiting(23, 16, 0), waiting(21, 0, 1), waiting(30, 0, 2)]
    prefills.waiting.extend(runs)
    finished, _, spent = prefills.run(None, None, 16)
    assert [r.row for r, _ in finished] == [0]
    assert model.calls == [([23], [16]), ([16], [0])] and spent == 23
    assert [(r.prefilled, len(r.req.args["input_ids"])) for r in prefills.waiting] == [(16, 21), (0, 30)]


def test_a_first_piece_never_runs_past_its_prompt() -> None:
    model = Recording()
    prefills = Prefills(model, chunk=16)
    prefills.waiting.append(waiting(21, 16, 0))  # a 5-token rest, over a budget of 3
    finished, _, spent = prefills.run(None, None, 3)
    assert model.calls == [([21], [16])] and spent == 5 and [r.row for r, _ in finished] == [0]



def _run(tokens: int, prefilled: int = 0) -> Any:
    return types.SimpleNamespace(req=types.SimpleNamespace(args={"input_ids": list(range(tokens))}),
                           prefilled=prefilled)


def test_a_short_prompt_past_a_spent_budget_is_one_piece_to_its_end() -> None:
    prefills = Prefills(types.SimpleNamespace(extend=True), chunk=256)
    short, long = _run(7), _run(40, prefilled=16)
    prefills.waiting = [short]
    assert prefills.plan(5) == [(short, 7)]  # not 16: the prompt has 7 tokens
    prefills.waiting = [long]
    assert prefills.plan(5) == [(long, 32)]  # a whole block, within the prompt
    prefills.waiting = [short, long]
    assert prefills.plan(20) == [(short, 7)]  # the second gets nothing of the 13 left
