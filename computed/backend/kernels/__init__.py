"""Native CPU kernels, built from source on the machine that runs them (docs/kernels.md).

- `sgmv.cc`: the segmented multi-LoRA product that decode and `forward_full`
  use on the CPU (computed/backend/native.py, `lora_sgmv`). XLA on CPU cannot
  multiply by a slot's A and B in place: every window of its loop copies them
  out of the pool first, and runs a handful of tiny ops, each with its own
  dispatch. The kernel groups the rows by slot and reads each slot's weights
  once, from the pool's own buffers.
- `dense.cc`: the model's products x W on AVX-512 and AVX2+FMA CPUs, over weights packed into
  column panels when the model loads (computed/model/packed.py; a bfloat16 model's as bfloat16
  bits, multiplied by VDPBF16PS where the CPU has AVX512-BF16); XLA's
  dot repacks W on every call and ran a decode step's products markedly slower.
- `attention.cc`: decode attention over the KV cache in place
  (computed/backend/native.py), each row over its own length; XLA copies the attended
  bucket of K and V out of the cache for every layer of every step.

They are compiled, into one library, with the C++ compiler (`$CXX`, else `g++`) against the XLA FFI
headers that jaxlib ships, with `-march=native` (or, with `LORAPLANE_KERNEL_ISA=avx2`, for AVX2+FMA: `-march=x86-64-v3`), into
`$LORAPLANE_KERNEL_DIR` (default `build/kernels/` at the repository root), as
a file named by a hash of the sources, the flags, jaxlib's version and the CPU,
so a change to any of them builds afresh and an unchanged one is reused.
Processes that start together take a file lock, and one of them compiles.
`make kernels` builds it ahead (`python -m computed.backend.kernels`); otherwise the
first use does, in about 3 s.

Where they cannot be used (no compiler, a failed build, a backend other than
the CPU, or `LORAPLANE_LORA_KERNEL=xla`), `available()` is False, the reason is
logged once, and the model runs on XLA alone (the LoRA window loop, attention
over length buckets), which gives the same results to float32 rounding.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

log = logging.getLogger("computed.backend.kernels")

HERE = Path(__file__).parent
SOURCES = (HERE / "sgmv.cc", HERE / "attention.cc", HERE / "dense.cc")
HEADERS = (HERE / "parallel.h", HERE / "vec.h")
TARGETS = {"loraplane_sgmv": "LoraplaneSgmv", "loraplane_decode_attention": "LoraplaneDecodeAttention",
           "loraplane_dense": "LoraplaneDense"}
SGMV, ATTENTION, DENSE = TARGETS
# No -ffast-math and no FMA contraction: the vector code is written out, so every sum has one order
# and a float32 and a bfloat16 pool that hold the same values give bit-identical terms.
FLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type")
ENV_SWITCH = "LORAPLANE_LORA_KERNEL"  # "xla": never use the kernel
ISA_ENV = "LORAPLANE_KERNEL_ISA"  # "avx2": build for AVX2+FMA whatever this CPU has beyond it
# The instruction-set flags for each ISA the build can be forced to (default: this CPU's own).
# avx2 is x86-64-v3 (the psABI level: AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE), which every AVX2 CPU
# from Haswell and Zen 1 on has; `-march=native -mno-avx512f` would instead keep whatever else this
# CPU has (AVX-VNNI, GFNI, ...) and build something no plain AVX2 machine could load.
ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-march=x86-64-v3", "-mtune=generic")}


class KernelError(RuntimeError):
    """The kernels could not be built or loaded; the message says why and what to do."""


def build_dir() -> Path:
    env = os.environ.get("LORAPLANE_KERNEL_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "build" / "kernels"


def forced_isa() -> str:
    """The ISA the build is forced to by $LORAPLANE_KERNEL_ISA, "native" where it is unset."""
    isa = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise KernelError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    return isa


def flags() -> tuple[str, ...]:
    """The compiler's flags for this build: the instruction-set flags, then FLAGS. A native build for a CPU
    without AVX-512 is tuned generically, as the forced AVX2 build is: tuned for Zen 3 (`-march=native`
    there), GCC folded the dense kernel's row vectors into its FMAs as memory operands, a load per FMA,
    and its bfloat16 products ran at 0.62-0.72x the generic build's rate (docs/kernels.md)."""
    tune = ("-mtune=generic",) if forced_isa() == "native" and "avx512f" not in built_isas() else ()
    return (*ISA_FLAGS[forced_isa()], *tune, *FLAGS)


def _cpu_id(compiler: str) -> str:
    """What the build's -march means here, as the compiler resolves it (a VM's /proc/cpuinfo may hide
    instruction sets the compiler still finds and uses); /proc/cpuinfo's flags where it cannot say.
    Asked once per compiler and ISA: `flags` and `library_path` both need it at every load."""
    return _resolve_target(compiler, forced_isa())


@functools.lru_cache(maxsize=8)
def _resolve_target(compiler: str, isa: str) -> str:
    march = list(ISA_FLAGS[isa])
    try:
        done = subprocess.run([compiler, *march, "-Q", "--help=target"], capture_output=True,
                              text=True, timeout=30)
        if done.returncode == 0 and done.stdout:
            return done.stdout
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


# vector instruction sets that decide which kernel paths can run, as -march=native names them
VECTOR_ISAS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512bf16")  # bf16: dense.cc's VDPBF16PS


def built_isas() -> list[str]:
    """The vector instruction sets the kernels are (or would be) compiled for here: what the
    compiler's -march (native, or the ISA forced by $LORAPLANE_KERNEL_ISA) enables, or
    /proc/cpuinfo's flags where it cannot say (an unforced build only)."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or "g++"
    cpu = _cpu_id(compiler)
    enabled = {line.split()[0].removeprefix("-m") for line in cpu.splitlines()
               if line.strip().startswith("-m") and line.rstrip().endswith("[enabled]")}
    if not enabled and forced_isa() == "native":  # /proc/cpuinfo's flags line
        enabled = set(cpu.split())
    return [isa for isa in VECTOR_ISAS if isa in enabled]


def library_path(compiler: str) -> Path:
    """Where the build for this source, compiler, flags, jaxlib and CPU lives."""
    from jaxlib import version as jaxlib_version

    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), compiler.encode(), " ".join(flags()).encode(),
                 jaxlib_version.__version__.encode(), _cpu_id(compiler).encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return build_dir() / f"loraplane-kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The compiled library, compiling it first if this source has no build yet."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise KernelError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH: install g++ or set CXX, "
                          "or set LORAPLANE_LORA_KERNEL=xla to use the pure-XLA LoRA loop")
    path = library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same file
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
        os.close(fd)
        cmd = [compiler, *flags(), "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise KernelError(f"compiling {', '.join(f.name for f in SOURCES)} failed ({' '.join(cmd)}):\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # whole or absent: a reader never sees half a library
    return path


_dense_panels = (0, 0)  # output columns per panel of the dense kernel: float32's, bfloat16's


@functools.cache
def _load() -> str | None:
    """Build, load and register the kernels once per process: None when they are in use, else why not."""
    if os.environ.get(ENV_SWITCH, "").lower() == "xla":
        return f"{ENV_SWITCH}=xla"
    if jax.default_backend() != "cpu":
        return f"the {jax.default_backend()} backend (the kernels are for the CPU)"
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        widths = lib.loraplane_dense_panel, lib.loraplane_dense_panel_bf16
        for width in widths:
            width.restype = ctypes.c_int64
        global _dense_panels
        _dense_panels = int(widths[0]()), int(widths[1]())
    except (KernelError, OSError, AttributeError) as e:
        log.warning("native kernels unavailable, running on XLA alone: %s", e)
        return str(e)
    return None


def available() -> bool:
    """Whether the kernels are built, loaded and registered for this process's backend."""
    return _load() is None


def dense_panel(bfloat16: bool = False) -> int:
    """Output columns per panel of the dense kernel's packed weights (computed/model/packed.py), or 0 where it
    cannot run: the kernels are unavailable, or built with neither AVX-512 (panels of 12) nor AVX2+FMA
    (panels of 6, blocked for its 16 vector registers; a bfloat16 weight's panels of 16 there, which
    AVX2 multiplies vectorised over columns, dense.cc `columns_bf16`)."""
    return _dense_panels[bool(bfloat16)] if available() else 0


def unavailable_reason() -> str | None:
    return _load()


def require() -> None:
    """Make sure the kernels are registered; KernelError (saying why) where they cannot be."""
    reason = _load()
    if reason is not None:
        raise KernelError(f"the native kernels are unavailable: {reason}")


def main() -> int:
    """`python -m computed.backend.kernels`: build (or find) the kernels' library and say where it is."""
    try:
        path = build()
    except KernelError as e:
        print(f"computed.backend.kernels: {e}", file=sys.stderr)
        return 1
    print(f"computed.backend.kernels: {path}")
    return 0
