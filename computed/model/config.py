"""The architecture a checkpoint's config.json describes (RoPE frequencies: computed/model/rope.py).

The rules (which configs a replica serves, transformers 4.x's and 5.x's forms) live in
shared/modelconfig.py, so that `pool init` and a replica refuse the same configs in the same words.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.modelconfig import Architecture, ModelConfigError, read_architecture

DTYPES = ("float32", "bfloat16")


class ModelLoadError(ValueError):
    """The checkpoint directory cannot be loaded as a model of one of the families served."""


@dataclass(frozen=True)
class DecoderConfig(Architecture):
    """The architecture, read from config.json; hashable (static under jit)."""

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> DecoderConfig:
        """Read a transformers 4.x or 5.x config.json of a served family (as a dict), with the checks `pool
        init` makes (shared/modelconfig.py)."""
        try:
            arch = read_architecture(cfg)
        except ModelConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        return cls(**{f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)})
