"""llama.cpp's side of bench_peer_llamacpp: runs in the peer's environment (build/llamacpp-venv).

What it runs, and why: docs/benchmarks.md, "peer_llamacpp_worker.py".
"""
from __future__ import annotations

import ctypes
import json
import sys
import time
from typing import Any

import numpy as np

import llama_cpp as lc  # type: ignore[import-not-found]

PER_SEQ_CTX = 256  # KV positions per sequence (prompt + the longest round, padded)


class Context:
    """One llama context with a sequence per row it serves, and its llama_batch."""

    def __init__(self, model: Any, n_rows: int, prompt: int, threads: int, n_vocab: int) -> None:
        p = lc.llama_context_default_params()
        p.n_ctx = PER_SEQ_CTX * n_rows
        p.n_seq_max = n_rows
        p.n_batch = max(512, n_rows * prompt)
        p.n_ubatch = p.n_batch  # the prefill in one piece
        p.n_threads = p.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.n_vocab, self.prompt = n_vocab, prompt
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(max(n_rows * prompt, 1), 0, 1)
        self.adapter: Any = None

    def use(self, adapter: Any) -> None:
        """Set the context's one adapter (or none) if it is not the one set."""
        if adapter is self.adapter:
            return
        if adapter is None:
            rc = lc.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            arr = (lc.llama_adapter_lora_p_ctypes * 1)(adapter)
            rc = lc.llama_set_adapters_lora(self.ctx, arr, 1, (ctypes.c_float * 1)(1.0))
        if rc != 0:
            raise RuntimeError("llama_set_adapters_lora failed")
        self.adapter = adapter

    def decode(self, toks: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of (token, position, sequence, wants logits); argmax of each output."""
        b = self.batch
        b.n_tokens = len(toks)
        for i, (tok, pos, seq, out) in enumerate(toks):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(out)
            b.seq_id[i][0] = seq
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for t in toks if t[3])
        logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1).astype(np.int64)


class Group:
    """Some rows of the batch on one adapter (or none), in a context of their own or a shared one
    (sequence ids `seqs` there); the adapter is set before each of the group's decodes (a no-op
    when it is the context's already)."""

    def __init__(self, context: Context, rows: list[int], seqs: list[int], adapter: Any,
                 prompts: np.ndarray) -> None:
        self.context, self.rows, self.seqs, self.adapter = context, rows, seqs, adapter
        self.prompt = prompts.shape[1]
        self.first = self._decode([(int(prompts[r, i]), i, s, i == self.prompt - 1)
                                   for r, s in zip(rows, seqs) for i in range(self.prompt)])

    def _decode(self, toks: list[tuple[int, int, int, bool]]) -> np.ndarray:
        self.context.use(self.adapter)
        return self.context.decode(toks)

    def restart(self) -> None:
        for s in self.seqs:
            lc.llama_memory_seq_rm(self.context.mem, s, self.prompt, -1)

    def step(self, tokens: np.ndarray, pos: int) -> np.ndarray:
        return self._decode([(int(tokens[j]), pos, s, True) for j, s in enumerate(self.seqs)])


class Workload:
    def __init__(self, groups: list[Group], batch: int) -> None:
        self.groups, self.batch = groups, batch

    def round(self, steps: int) -> tuple[float, list[list[int]]]:
        for g in self.groups:
            g.restart()
        current = [g.first for g in self.groups]
        out = []
        t0 = time.perf_counter()
        for k in range(steps):
            row = np.zeros(self.batch, np.int64)
            for i, g in enumerate(self.groups):
                current[i] = g.step(current[i], self.groups[0].prompt + k)
                row[g.rows] = current[i]
            out.append(row.tolist())
        return time.perf_counter() - t0, out


def main() -> int:
    lc.llama_backend_init()
    models: dict[str, Any] = {}
    adapters: dict[str, Any] = {}
    workloads: dict[str, Workload] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "info":
                reply: dict[str, Any] = {"system_info": lc.llama_print_system_info().decode(),
                                         "version": getattr(lc, "__version__", "?")}
            elif cmd["op"] == "setup":
                path = cmd["model"]
                if path not in models:
                    mp = lc.llama_model_default_params()
                    models[path] = lc.llama_model_load_from_file(path.encode(), mp)
                    if not models[path]:
                        raise RuntimeError(f"llama_model_load_from_file failed on {path}")
                model = models[path]
                n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
                prompts = np.asarray(cmd["prompts"], np.int64)
                groups = []
                shared = None
                if cmd.get("mode") == "switch":  # one context for every row, the adapter switched per group
                    shared = Context(model, len(prompts), prompts.shape[1], cmd["threads"], n_vocab)
                for rows, apath in cmd["groups"]:
                    adapter = None
                    if apath:
                        if apath not in adapters:
                            adapters[apath] = lc.llama_adapter_lora_init(model, apath.encode())
                            if not adapters[apath]:
                                raise RuntimeError(f"llama_adapter_lora_init failed on {apath}")
                        adapter = adapters[apath]
                    if shared is None:
                        groups.append(Group(Context(model, len(rows), prompts.shape[1], cmd["threads"], n_vocab),
                                            rows, list(range(len(rows))), adapter, prompts))
                    else:
                        groups.append(Group(shared, rows, rows, adapter, prompts))
                workloads[cmd["key"]] = Workload(groups, len(prompts))
                reply = {"contexts": 1 if shared else len(groups)}
            elif cmd["op"] == "round":
                seconds, tokens = workloads[cmd["key"]].round(cmd["steps"])
                reply = {"seconds": seconds, "tokens": tokens}
            elif cmd["op"] == "quit":
                break
            else:
                raise ValueError(f"unknown op {cmd['op']!r}")
        except Exception as e:  # the bench reports it; this process keeps answering
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
