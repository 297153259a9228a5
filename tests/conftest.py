from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from statesvc.service import StateService
from statesvc.tools.example import ExampleAssets, make_example
from testkit.fleet import StateSvc
from testkit.inproc import init_pool, open_service
from testkit.pg import PgServer
from tests.helpers import Fleet, xla_flags
from tests.cpu_report import pytest_runtest_protocol  # noqa: F401  (the CPU report hook)


# A JAX persistent compilation cache that every process the tests start inherits, both xdist
# workers and a pytest a test runs included, so a replica's warm-up compiles the example model
# once instead of once per replica. It persists between runs in build/test-xla-cache/<key>
# (ignored by git): a second `make test` reads back what the first compiled. JAX keys each entry
# by its HLO, compile options, XLA flags and jax's version; the directory's key adds what that
# cannot see, as computed/model/compile_cache.py does for a replica: jaxlib, the CPU and the
# native kernels' build (named by their sources, flags and compiler); only the current key's
# directory is kept (the kernels' sources change it). A clean clone starts
# empty; LORAPLANE_TEST_FRESH_CACHE=1 gives a session a fresh temporary cache instead (what CI's
# first run sees). testkit/jaxcount.py still counts a cache hit as a compile: "nothing compiles
# after warm-up" keeps its meaning. A benchmark whose figure times a cold compile, and the
# replica's own-cache test, run without it (benchmarks/suite.py `Bench.cold_compiles`,
# tests/integration/test_compile_cache_restart.py). docs/testing.md.
SESSION_CACHE = "LORAPLANE_TEST_JAX_CACHE"  # the directory, set by the session that chose it
FRESH = "LORAPLANE_TEST_FRESH_CACHE"
CACHE_ROOT = Path(__file__).resolve().parents[1] / "build" / "test-xla-cache"
CACHE_MAX_BYTES = 4 << 30  # JAX evicts its least recently used entries past this
_made_cache = pytest.StashKey[str]()
# The tests' XLA compiles at LLVM -O0 without its expensive passes: compiling is most of what the
# parity, serving and tensor-parallel tests spend (a fresh clone compiles every program), and the
# programs they run are small. The flags change how fast XLA's code runs, not what it computes
# (fast math stays off: XLA CPU's default), so every comparison with transformers + PEFT holds
# as written; LORAPLANE_TEST_XLA_OPT=1 runs a session at XLA's own optimisation, as a replica and
# `make bench` do (docs/testing.md).
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
OPTIMISED = "LORAPLANE_TEST_XLA_OPT"


def cache_key() -> str:
    """The persistent test cache's directory name for this jax, jaxlib, CPU and kernel build."""
    import hashlib
    import platform

    import jax
    from jaxlib import version as jaxlib_version

    from computed.backend import kernels

    compiler = shutil.which(os.environ.get("CXX", "g++")) or "g++"
    try:
        cpu = "\n".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith(("model name", "flags", "Features")))
    except OSError:
        cpu = platform.processor()
    parts = [jax.__version__, jaxlib_version.__version__, platform.machine(), cpu,
             kernels.library_path(compiler).name, os.environ.get("XLA_FLAGS", "")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def pytest_configure(config: pytest.Config) -> None:
    inherited = os.environ.get(SESSION_CACHE)
    if inherited and Path(inherited).is_dir():  # an xdist worker, or a pytest a test started
        return
    if os.environ.get(OPTIMISED, "") in ("", "0"):  # before the key, which holds XLA_FLAGS
        os.environ["XLA_FLAGS"] = xla_flags(*FAST_COMPILE)
    if os.environ.get(FRESH, "") not in ("", "0"):
        path = tempfile.mkdtemp(prefix="loraplane-jax-cache-")
        config.stash[_made_cache] = path  # removed at the end
    else:
        path = str(CACHE_ROOT / cache_key())
        for stale in CACHE_ROOT.glob("*"):  # another jax, CPU or kernel build: never read again here
            if stale.is_dir() and str(stale) != path:
                shutil.rmtree(stale, ignore_errors=True)
        Path(path).mkdir(parents=True, exist_ok=True)
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": path, SESSION_CACHE: path,
                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # default: 1 s
                       "JAX_COMPILATION_CACHE_MAX_SIZE": str(CACHE_MAX_BYTES)})
    if "jax" in sys.modules:  # imported before this hook: its flags were read already
        import jax
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_made_cache, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that hold `slow` tests run first, each module's own order kept: under
    `make test`'s two workers (pytest-xdist, one module per worker at a time, in this order
    with --no-loadscope-reorder) the longest modules start at once instead of leaving one
    worker alone with them at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def example(tmp_path_factory: pytest.TempPathFactory) -> ExampleAssets:
    """The example checkpoint and adapters, written once per test session."""
    return make_example(tmp_path_factory.mktemp("example"), seed=0)


@pytest.fixture
def svc(tmp_path: Path, example: ExampleAssets) -> Iterator[StateService]:
    """The state service in-process over SQLite in tmp_path, the example's pool configured."""
    service = open_service(tmp_path / "data")
    init_pool(service, example.model_dir)
    yield service
    service.store.close()


@pytest.fixture
def statesvc(tmp_path: Path) -> Iterator[StateSvc]:
    svc = StateSvc(tmp_path / "data")
    try:
        yield svc.start()
    finally:
        svc.stop()


@pytest.fixture
def fleet(tmp_path: Path, example: ExampleAssets) -> Iterator[Fleet]:
    f = Fleet(tmp_path, example)
    f.statesvc.start()
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One real PostgreSQL server for the session (testkit/pg.py), stopped by pid at the end;
    tests are skipped, saying why, only where the server binaries are missing."""
    why = PgServer.missing()
    if why is not None:
        pytest.skip(why)
    server = PgServer()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """The URL of a new, empty database on the session's PostgreSQL server."""
    return pg_server.database()


@pytest.fixture
def two(tmp_path: Path, pg_url: str) -> Iterator[tuple[StateSvc, StateSvc]]:
    """Two statesvc instances on one new PostgreSQL database (docs/postgres.md)."""
    a = StateSvc(tmp_path / "a", extra_args=("--db", pg_url))
    b = StateSvc(tmp_path / "b", extra_args=("--db", pg_url))
    try:
        yield a.start(), b.start()
    finally:
        a.stop()
        b.stop()
