"""The native kernels' build, and the pure-XLA fallback a replica takes without them.

Their arithmetic is checked against PEFT and float64 references in tests/parity/test_model_parity.py."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from computed.backend import kernels
from statesvc.tools.example import ExampleAssets

REPO = Path(__file__).resolve().parents[2]


def test_without_a_compiler_the_build_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("LORAPLANE_KERNEL_DIR", str(tmp_path / "kernels"))
    with pytest.raises(kernels.KernelError, match="no C\\+\\+ compiler .*LORAPLANE_LORA_KERNEL=xla"):
        kernels.build()
    assert not (tmp_path / "kernels").exists()


def test_the_kernels_isas_are_what_the_compiler_enables(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Benchmarks record the vector ISAs the kernels are built for: -march=native as the compiler
    resolves it (a VM's /proc/cpuinfo may hide AVX-512 that g++ still enables)."""
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\nprintf '  -mavx2  [enabled]\\n  -mavx512f  [disabled]\\n"
                    "  -mfma  [enabled]\\n  -mavx512vl  [enabled]\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert kernels.built_isas() == ["avx2", "fma", "avx512vl"]


def test_a_failed_compile_reports_the_compiler_and_leaves_no_library(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\necho 'sgmv.cc:1: error: this compiler refuses' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("LORAPLANE_KERNEL_DIR", str(tmp_path / "kernels"))
    with pytest.raises(kernels.KernelError, match="(?s)failed .*this compiler refuses"):
        kernels.build()
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [".lock"]  # no half-built library


def test_a_build_is_reused_until_its_source_or_flags_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the session's own build directory (`make kernels` built it, or the first replica that loads
    the kernels does): a build of its own here would only compile the same library again."""
    first = kernels.build()
    stamp = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == stamp  # found, not rebuilt
    monkeypatch.setattr(kernels, "FLAGS", kernels.FLAGS + ("-DLORAPLANE_OTHER_FLAGS",))
    assert kernels.library_path(shutil.which(os.environ.get("CXX", "g++")) or "g++") != first


def test_the_isa_can_be_forced_to_avx2_in_its_own_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """LORAPLANE_KERNEL_ISA=avx2 builds for AVX2+FMA (x86-64-v3) whatever this CPU has beyond it, under
    its own name, and says so to the benchmarks' machine info."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"AVX2 is an x86 instruction set; this is {platform.machine()}")
    compiler = shutil.which(os.environ.get("CXX", "g++")) or "g++"
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    native_path = kernels.library_path(compiler)
    monkeypatch.setenv(kernels.ISA_ENV, "AVX2")
    assert kernels.built_isas() == ["avx2", "fma"]
    assert "-march=x86-64-v3" in kernels.flags() and "-march=native" not in kernels.flags()
    assert kernels.library_path(compiler) != native_path
    monkeypatch.setenv(kernels.ISA_ENV, "sse9")
    with pytest.raises(kernels.KernelError, match="LORAPLANE_KERNEL_ISA='sse9': expected one of native, avx2"):
        kernels.flags()


AVX2_CHECK = """
import json
from computed.backend import kernels
print(json.dumps({"isas": kernels.built_isas(), "available": kernels.available(), "panel": kernels.dense_panel(),
                  "library": kernels.build().name}))
"""
# the kernels against float64 references, and the model through the native backend against PEFT
AVX2_TESTS = ("attention_kernel or segmented_lora or every_decode_window or kernel_stops or bfloat16_pool"
              " or dense_kernel or forward_full or inactive_rows or base_rows or peft_in_bfloat16"
              " or packed_lm_head")
# the kernels alone against their float64 references: where this CPU's own build is already AVX2+FMA
# and nothing more, the suite's parity tests run the model through that ISA set's kernels, so the
# forced build's run checks its kernels' arithmetic and leaves the model-level cases to them
AVX2_KERNEL_TESTS = "attention_kernel or segmented_lora or kernel_stops or bfloat16_pool or dense_kernel"


@pytest.mark.slow  # its own library build and a pytest of the parity checks: out of `make test-quick`
def test_the_avx2_build_matches_the_float64_references(tmp_path: Path) -> None:
    """The AVX2+FMA build, forced on whatever x86 CPU runs the tests: the kernel and parity checks of
    tests/parity run in a process of their own, on a library built into a directory of its own."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"AVX2 is an x86 instruction set; this is {platform.machine()}")
    here = {k: v for k, v in os.environ.items() if k != kernels.ISA_ENV}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(kernels.ISA_ENV, raising=False)
        native_isas = kernels.built_isas()
        if not {"avx2", "fma"} <= set(native_isas):
            pytest.skip("this CPU has no AVX2+FMA")
        native_library = kernels.build()  # the suite's own (`make kernels`)
    selected = AVX2_KERNEL_TESTS if native_isas == ["avx2", "fma"] else AVX2_TESTS
    env = {**here, kernels.ISA_ENV: "avx2", "LORAPLANE_KERNEL_DIR": str(tmp_path / "kernels"), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["isas"] == ["avx2", "fma"] and out["available"] is True
    assert out["panel"] == 6  # the dense kernel's AVX2 blocking: 2 x 6 accumulators in 16 registers
    assert [p.name for p in (tmp_path / "kernels").glob("*.so")] == [out["library"]]
    if selected == AVX2_KERNEL_TESTS and (tmp_path / "kernels" / out["library"]).read_bytes() == \
            native_library.read_bytes():
        # the forced build is byte for byte this CPU's native library (x86-64-v3 and -march=native
        # compile the same code here): the suite's kernel checks run on these very instructions
        return
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selected,
                           str(REPO / "tests" / "parity" / "test_model_parity.py"),
                           str(REPO / "tests" / "parity" / "test_bfloat16_parity.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout and " skipped" not in done.stdout
    assert [p.name for p in (tmp_path / "kernels").glob("*.so")] == [out["library"]]  # no native build


FALLBACK = """
import json, sys
import numpy as np
from computed.model import lora
from computed.backend import native
from testkit.jaxcount import counting_compiles
from computed.model.loader import load_model
from computed.model.packed import PackedWeight
from computed.model.runner import Runner
from computed.residency.pool import MemoryPool, PoolSpec

config, params = load_model(sys.argv[1])
pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims, slots=4, max_rank=8,
                           dtype="float32"))
runner = Runner(config, params, max_batch=4, max_len=32, prefill_tokens=32)  # 2 buckets, 3 prefill shapes
cache = runner.new_cache()
runner.warmup(pool.arrays, cache)
rng = np.random.default_rng(0)
with counting_compiles() as compiles:
    for mix in ([-1] * 4, [0] * 4, [0, 1, 2, 3], [3, 3, -1, 1]):
        for longest in (1, 16, 17, 31):  # positions in every bucket, each end of each
            positions = np.minimum(np.arange(4) * 7, longest - 1).astype(np.int32)
            positions[0] = longest - 1
            logits, cache = runner.decode(pool.arrays, cache, rng.integers(0, 256, 4).astype(np.int32), positions,
                                          np.array(mix, np.int32), np.ones(4, bool))
print(json.dumps({"available": native.available(), "reason": native.unavailable_reason(),
                  "windows": list(params.backend.windows(4)), "loop_windows": list(lora.loop_windows(4)),
                  "backend": type(params.backend).__name__, "blocked": cache.blocked,
                  "packed": isinstance(params.layers[0].weights["q_proj"], PackedWeight), "compiles": len(compiles),
                  "finite": bool(np.isfinite(logits).all())}))
"""


@pytest.mark.slow  # a process that warms up every bucket on XLA alone: out of `make test-quick`
def test_the_xla_switch_serves_on_xla_alone_with_no_compiles_after_warmup(example: ExampleAssets) -> None:
    """What a replica without a compiler runs: XLA's dot on unpacked weights, the window loop and bucket
    attention, all compiled at warm-up."""
    env = {**os.environ, "LORAPLANE_LORA_KERNEL": "xla", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", FALLBACK, str(example.model_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["available"] is False and out["reason"] == "LORAPLANE_LORA_KERNEL=xla"
    assert out["windows"] == out["loop_windows"] and 0 not in out["windows"]
    assert out["backend"] == "XlaBackend" and not out["blocked"] and out["packed"] is False  # XLA's attention
    assert out["compiles"] == 0
    assert out["finite"]


def test_each_figure_names_the_isa_its_kernels_were_built_for() -> None:
    from benchmarks.harness.machine import isa_label
    from benchmarks.harness.records import summary_table

    assert isa_label(["avx2", "fma"]) == "AVX2+FMA"
    assert isa_label(["avx2", "fma", "avx512f", "avx512bw"]) == "AVX-512"
    assert isa_label(["avx2", "fma", "avx512f", "avx512bf16"]) == "AVX-512 (BF16)"
    fig = {"name": "decode, base model, batch 32", "value": 700.0, "unit": "tokens/s",
           "target": None, "meets": None, "spread": None, "runs": 1, "bench": "decode",
           "cpu": "AMD EPYC", "isa": "AVX2+FMA"}
    table = summary_table({"machine": {}, "date": "now", "figures": [fig], "runs": {}, "plots": []})
    assert "| AMD EPYC, AVX2+FMA |" in table
    # an AVX2 build says whether its CPU is an AVX2 one or an AVX-512 one capped at AVX2
    native = summary_table({"machine": {}, "date": "now", "plots": [], "runs": {},
                            "figures": [{**fig, "cpu_isas": ["avx2", "fma"]}]})
    forced = summary_table({"machine": {}, "date": "now", "plots": [], "runs": {},
                            "figures": [{**fig, "cpu_isas": ["avx2", "fma", "avx512f"]}]})
    assert "| AMD EPYC, AVX2+FMA (native) |" in native
    assert "| AMD EPYC, AVX2+FMA (forced on an AVX-512 CPU) |" in forced
