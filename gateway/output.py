"""What a generation request's answer is before it is written out: `Output`, one per choice
(gateway/service.py makes it; app.py, streaming.py and logprobs.py write it as OpenAI's JSON)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Output:
    prompt_tokens: int
    ids: list[int]  # the tokens whose text is `text` (stop token and past a stop string cut)
    completion_tokens: int  # what the replica generated (a stop token counts)
    text: str
    finish_reason: str  # "stop", "length" or "tool_calls"
    replica: str
    timings: dict[str, float] | None = None  # passed_on(): None when ended early (a stop string)
    others: list[Output] = field(default_factory=list)  # choices 1 .. n-1 (n > 1)
    # OpenAI's tool_calls parsed from the answer (`text` is then the content before them)
    tool_calls: list[dict[str, Any]] | None = None
    # where the model may call tools: the text they were parsed from (special tokens kept when
    # the format's marker is one), which a stream's ToolStream completes at the end
    tool_source: str | None = None
    # where the request asked for logprobs (gateway/logprobs.py): the scores of `ids`, and with
    # echo the prompt's tokens and theirs (the first None)
    scores: list[dict[str, Any] | None] | None = None
    prompt_ids: list[int] | None = None
    prompt_scores: list[dict[str, Any] | None] | None = None

    @property
    def choices(self) -> list[Output]:
        """Every choice, in index order: this one first."""
        return [self, *self.others]

    @property
    def all_completion_tokens(self) -> int:
        """Usage's completion_tokens: every returned choice's."""
        return self.completion_tokens + sum(o.completion_tokens for o in self.others)
