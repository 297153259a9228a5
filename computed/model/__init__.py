"""The decoder of every served family in JAX, with multi-LoRA and a KV cache, for the replica's serving loop.

- config.py: the architecture config.json describes, RoPE frequencies
- params.py: the parameter pytree, packed weights
- loader.py: checkpoint shards into parameters laid out for a backend (`load_model`, `with_layout`)
- kv_cache.py: the KV cache's two layouts of K, and the writes into it
- attention.py: causal and bucket attention in XLA
- decoder.py: the decoder over a family's architecture, the forward pass (jitted entry points)
- runner.py: host-side checks, `prefill` / `prefill_batch` / `decode` / `forward_full`, warm-up,
  `Runner` (batched prefill: prompts grouped by length bucket, forwards of (n, P) shapes)

The compute (dense products, LoRA terms, decode attention) is the backend's, chosen once at load
(computed/backend). This package imports nothing at import time, so that the backend package
and the model can import each other's modules.
"""
