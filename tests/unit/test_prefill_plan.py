"""Prefills.plan as pure logic: a piece never runs past its prompt's end, even when what is
left of the step's budget is less than a block (a first piece then takes up to one block)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from computed.serving.prefill import Prefills


def _run(tokens: int, prefilled: int = 0) -> Any:
    return SimpleNamespace(req=SimpleNamespace(args={"input_ids": list(range(tokens))}),
                           prefilled=prefilled)


def test_a_short_prompt_past_a_spent_budget_is_one_piece_to_its_end() -> None:
    prefills = Prefills(SimpleNamespace(extend=True), chunk=256)
    short, long = _run(7), _run(40, prefilled=16)
    prefills.waiting = [short]
    assert prefills.plan(5) == [(short, 7)]  # not 16: the prompt has 7 tokens
    prefills.waiting = [long]
    assert prefills.plan(5) == [(long, 32)]  # a whole block, within the prompt
    prefills.waiting = [short, long]
    assert prefills.plan(20) == [(short, 7)]  # the second gets nothing of the 13 left
