"""PEFT LoRA tensor names <-> (layer, module, A or B)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from shared.projections import MODULE_PARENT, MODULES

_NAME_RE = re.compile(
    r"base_model\.model\.model\.layers\.(0|[1-9][0-9]{0,5})\.(self_attn|mlp)\."
    rf"({'|'.join(MODULES)})\.lora_(A|B)\.weight")


@dataclass(frozen=True, order=True)
class LoraKey:
    layer: int
    module: str
    matrix: Literal["A", "B"]


def lora_name(key: LoraKey) -> str:
    parent = MODULE_PARENT[key.module]
    return f"base_model.model.model.layers.{key.layer}.{parent}.{key.module}.lora_{key.matrix}.weight"


def parse_lora_name(name: str) -> LoraKey | None:
    """The key a PEFT tensor name stands for, or None when it is not a LoRA weight of a target projection."""
    m = _NAME_RE.fullmatch(name)
    if m is None or MODULE_PARENT[m.group(3)] != m.group(2):
        return None
    matrix: Literal["A", "B"] = "A" if m.group(4) == "A" else "B"
    return LoraKey(int(m.group(1)), m.group(3), matrix)
