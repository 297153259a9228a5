"""Facts of the decoder's projections that every side agrees on: the projections LoRA may
target, the submodule that holds each one, and each one's (in, out) features.

`pool init` (shared/fingerprint.py via shared/modelconfig.py), the PEFT name and
config rules (shared/peft.py, statesvc/peft_config.py), the example writer and
the replica's model all read them here. No jax or numpy: statesvc imports this.
"""
from __future__ import annotations

# LoRA target modules of every served family's decoder layer, in canonical order, with the
# submodule that holds each one.
MODULE_PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
MODULES: tuple[str, ...] = tuple(MODULE_PARENT)
ATTN_MODULES: tuple[str, ...] = tuple(m for m in MODULES if MODULE_PARENT[m] == "self_attn")
MLP_MODULES: tuple[str, ...] = tuple(m for m in MODULES if MODULE_PARENT[m] == "mlp")


def module_dims(*, hidden_size: int, intermediate_size: int, num_heads: int,
                num_kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """Target module -> (in_features, out_features), in MODULES order."""
    h, q, kv, i = hidden_size, num_heads * head_dim, num_kv_heads * head_dim, intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
