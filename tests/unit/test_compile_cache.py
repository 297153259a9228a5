"""The session's JAX compilation cache (tests/conftest.py, docs/testing.md): the processes the
tests start share it, and a compile it serves still counts as a compile, so every "nothing
compiles after warm-up" assertion keeps catching a new shape."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.conftest import SESSION_CACHE

REPO = Path(__file__).resolve().parents[2]

# one jitted function of its own (the constant makes its module new to the cache), called on a
# numpy array so that nothing else compiles
COMPILE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from testkit.jaxcount import counting_compiles
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
salt = float(sys.argv[1])
with counting_compiles() as compiles:
    jax.jit(lambda x: jnp.tanh(x) * salt)(np.ones(7, np.float32)).block_until_ready()
print(json.dumps({"compiles": len(compiles), "hits": len(hits)}))
"""


def _compile(salt: str) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", COMPILE, salt], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_started_processes_share_the_cache_and_a_hit_counts_as_a_compile() -> None:
    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    assert cache.is_dir() and os.environ[SESSION_CACHE] == str(cache)
    salt = f"1.{uuid.uuid4().int % 10**12:012d}"
    before = set(cache.iterdir())
    assert _compile(salt) == {"compiles": 1, "hits": 0}
    assert set(cache.iterdir()) - before  # its entry, written for the next process
    assert _compile(salt) == {"compiles": 1, "hits": 1}
