"""PEFT's side of bench_decode (transformers + PEFT mixed-batch decoding, in a process of its own),
and the GEMM rates of XLA, the dense kernel and torch on the MLP's product.

What it runs: docs/benchmarks.md, "bench_decode.py".
"""
from __future__ import annotations

import copy
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.decode_paths import BATCH, MIXES, PROMPT, SHAPE, RequestTiming, adapter_names, row_adapters
from benchmarks.harness import Timing, timed
from computed.backend import native
from computed.model.packed import pack

class PeftDecode:
    """PEFT mixed-batch greedy decoding with a KV cache; each round crops the cache back to the prompt."""

    def __init__(self, model: Any, prompts: np.ndarray, rows: list[int]) -> None:
        import torch
        self.torch, self.model = torch, model
        names = adapter_names()
        self.names = ["__base__" if a < 0 else names[a] for a in rows]
        self.prompts = torch.as_tensor(prompts, dtype=torch.long)
        with torch.no_grad():
            out = model(input_ids=self.prompts, use_cache=True, adapter_names=self.names, logits_to_keep=1)
        self.cache = out.cache
        # a sliding-window layer's cache cannot be cropped back once the window is full: each
        # round of such a model (bench_families) restarts from a copy of the prefilled cache
        self.prefilled = copy.deepcopy(self.cache) if any(getattr(self.cache, "is_sliding", ())) else None
        self.first = out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens: list[np.ndarray] = []

    def requests(self, clients: int, new_tokens: int, timing: RequestTiming | None) -> list[list[int]]:
        """The served path's work, as PEFT does it: the first `clients` prompts prefilled as one
        batch into a fresh cache, then greedy decoding until each has `new_tokens` new tokens
        (the first from the prefill); returns each row's tokens."""
        torch, model = self.torch, self.model
        names = self.names[:clients]
        out = []
        with torch.no_grad(), timed(timing):
            first = model(input_ids=self.prompts[:clients], use_cache=True, adapter_names=names,
                          logits_to_keep=1)
            cache, tokens = first.cache, first.logits[:, -1].argmax(-1, keepdim=True)
            out.append(tokens)
            for _ in range(new_tokens - 1):
                logits = model(input_ids=tokens, cache=cache, use_cache=True, adapter_names=names).logits
                tokens = logits[:, -1].argmax(-1, keepdim=True)
                out.append(tokens)
        if timing is not None:
            timing.tokens.append(clients * new_tokens)
        return torch.cat(out, dim=1).tolist()  # type: ignore[no-any-return]

    def round(self, steps: int, timing: Timing | None) -> None:
        torch, model = self.torch, self.model
        surplus = self.cache.get_seq_length() - PROMPT
        if self.prefilled is not None:
            self.cache = copy.deepcopy(self.prefilled)
        elif surplus:
            self.cache.crop(-surplus)
        tokens, out = self.first, []
        with torch.no_grad(), timed(timing):
            for _ in range(steps):
                logits = model(input_ids=tokens, cache=self.cache, use_cache=True,
                               adapter_names=self.names).logits
                tokens = logits[:, -1].argmax(-1, keepdim=True)
                out.append(tokens[:, 0].numpy().astype(np.int32))
        self.tokens = out


def load_peft(model_dir: Path, dirs: dict[str, Path], threads: int) -> Any:
    import peft
    import torch
    import transformers
    torch.set_num_threads(threads)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    names = list(dirs)  # adapter_names(), or the first of them (bench_families)
    model = peft.PeftModel.from_pretrained(base, str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(dirs[name]), adapter_name=name)
    return model.eval()


def peft_worker(conn: Connection, model_dir: Path, dirs: dict[str, Path], threads: int,
                prompts: np.ndarray, mixes: tuple[int, ...] | None = None) -> None:
    """The PEFT side, in its own process: runs a round when told to and answers its timing and tokens
    (on `mixes`, by default MIXES).

    A process of its own because torch and XLA in one process slow each other
    down: PEFT's steps there took up to 15 times as long as alone.
    """
    import peft
    import torch
    import transformers
    model = load_peft(model_dir, dirs, threads)
    runs = {k: PeftDecode(model, prompts, row_adapters(k)) for k in (mixes or MIXES)}
    conn.send({"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
               "attn_implementation": model.base_model.model.config._attn_implementation})
    while True:
        msg = conn.recv()
        if msg[0] == "round":
            _, k, steps, count = msg
            timing = Timing()
            runs[k].round(steps, timing if count else None)
            conn.send((timing, runs[k].tokens))
        elif msg[0] == "requests":
            _, k, clients, new_tokens, count = msg
            requests = RequestTiming()
            outputs = runs[k].requests(clients, new_tokens, requests if count else None)
            conn.send((requests, outputs))
        elif msg[0] == "gemm":
            conn.send(gemm_rate_torch(threads, msg[1]))
        else:
            conn.close()
            return


class PeftProcess:
    """The parent's handle on peft_worker. It returns at once: PEFT loads in its process while
    ours start (its versions, `info`, arrive once it has loaded; every call waits for them)."""

    def __init__(self, model_dir: Path, dirs: dict[str, Path], threads: int, prompts: np.ndarray,
                 mixes: tuple[int, ...] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peft_worker, args=(child, model_dir, dirs, threads, prompts, mixes),
                                daemon=True)
        self.proc.start()
        child.close()
        self._info: dict[str, str] | None = None
        self.tokens: dict[int, list[np.ndarray]] = {}

    @property
    def info(self) -> dict[str, str]:
        """Its torch, transformers and PEFT versions and attention, once it has loaded."""
        if self._info is None:
            self._info = self.conn.recv()
        return self._info

    def _send(self, *msg: Any) -> None:
        assert self.info  # loaded: the first message on the pipe is its info
        self.conn.send(msg)

    def round(self, k: int, steps: int, timing: Timing | None) -> None:
        self._send("round", k, steps, timing is not None)
        got, self.tokens[k] = self.conn.recv()
        if timing is not None:
            timing.add(got)

    def requests(self, k: int, clients: int, new_tokens: int, timing: RequestTiming | None) -> list[list[int]]:
        """PeftDecode.requests in PEFT's process; returns the tokens."""
        self._send("requests", k, clients, new_tokens, timing is not None)
        got, outputs = self.conn.recv()
        if timing is not None:
            timing.add(got)
        return outputs  # type: ignore[no-any-return]

    def gemm_rate(self, iters: int = 50) -> float:
        self._send("gemm", iters)
        return float(self.conn.recv())

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(timeout=30)



# --------------------------------------------------------------------------- GEMM rates

GEMM = (BATCH, SHAPE.hidden_size, SHAPE.intermediate_size)  # the MLP's up/gate product in a decode step


def _rate(call: Callable[[], Any], sync: Callable[[Any], Any], iters: int = 50) -> float:
    """GFLOP/s of the GEMM product, best of 3 runs of `iters` calls."""
    n, k, m = GEMM
    sync(call())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            y = call()
        sync(y)
        best = min(best, (time.perf_counter() - t0) / iters)
    return round(2 * n * k * m / best / 1e9, 1)


def _gemm_operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n, k, m = GEMM
    return rng.standard_normal((n, k), np.float32), rng.standard_normal((k, m), np.float32)


def gemm_rate_xla(iters: int = 50) -> float:
    x, w = _gemm_operands()
    f = jax.jit(lambda a, b: a @ b)
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    return _rate(lambda: f(xj, wj), jax.block_until_ready, iters)


def gemm_rate_kernel(iters: int = 50) -> float | None:
    """The dense kernel's rate on the same product over the packed weight; None where it cannot run."""
    panel = native.dense_panel()
    if not panel:
        return None
    x, w = _gemm_operands()
    f = jax.jit(lambda a, b: native.dense_matmuls(a, [b])[0])
    xj, wp = jnp.asarray(x), pack(w, panel)
    return _rate(lambda: f(xj, wp), jax.block_until_ready, iters)


def gemm_rate_torch(threads: int, iters: int = 50) -> float:
    import torch
    torch.set_num_threads(threads)
    x, w = _gemm_operands()
    xt, wt = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(w.T))
    return _rate(lambda: torch.nn.functional.linear(xt, wt), lambda y: y, iters)
