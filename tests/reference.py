"""Hugging Face transformers + PEFT as the reference for served outputs (test-only)."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class HFReference:
    """Greedy continuations from transformers + PEFT, cached by (adapter dir, prompt, n)."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        import transformers
        torch.set_num_threads(1)  # a tiny model: threads only fight XLA for the 2 cores
        self.torch = torch
        self.base = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32).eval()
        self.peft_model = None
        self.names: dict[Path, str] = {}
        self.cache: dict[tuple[Path | None, tuple[int, ...], int], list[int]] = {}

    def _select(self, adapter_dir: Path | None) -> object:
        if adapter_dir is None:
            return self.base if self.peft_model is None else None
        import peft
        if adapter_dir not in self.names:
            name = f"a{len(self.names)}"
            if self.peft_model is None:
                self.peft_model = peft.PeftModel.from_pretrained(self.base, str(adapter_dir),
                                                                 adapter_name=name)
            else:
                self.peft_model.load_adapter(str(adapter_dir), adapter_name=name)
            self.names[adapter_dir] = name
        assert self.peft_model is not None
        self.peft_model.set_adapter(self.names[adapter_dir])
        return self.peft_model

    def greedy(self, adapter_dir: Path | None, prompt: list[int], n: int) -> list[int]:
        key = (adapter_dir, tuple(prompt), n)
        if key not in self.cache:
            self.cache[key] = self._greedy(adapter_dir, prompt, n)
        return self.cache[key]

    def _greedy(self, adapter_dir: Path | None, prompt: list[int], n: int) -> list[int]:
        torch = self.torch
        model = self._select(adapter_dir)
        ids = list(prompt)
        with torch.no_grad():
            if model is None:  # the base model under a PeftModel
                assert self.peft_model is not None
                with self.peft_model.disable_adapter():
                    return self._loop(self.peft_model, ids, n)
            return self._loop(model, ids, n)

    def _loop(self, model: object, ids: list[int], n: int) -> list[int]:
        torch = self.torch
        out = []
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]  # type: ignore[operator]
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
        return out
