"""Long fuzz runs of the decoders, beyond the bounded ones in `make test`.

Two engines, the same oracles (the check_* functions of testkit/fuzz_oracles.py):

* Hypothesis (default): the properties of tests/property/test_fuzz.py, LORAPLANE_FUZZ_EXAMPLES
  random examples each, round after round with a fresh seed, until the time is up or a
  round fails. A failure prints the falsifying example and the seed to replay it with.

      .venv/bin/python -m benchmarks.fuzz_long --minutes 30 [--examples 2000]

* atheris (coverage-guided, libFuzzer): one decoder fed bytes, its code instrumented,
  seeded with valid inputs; --target all runs each target in turn in its own process.
  A crash or a slow input (over --input-timeout s, i.e. a hang) stops it and leaves the
  input in var/fuzz/TARGET/ (crash-*, timeout-*, oom-*); replay it with --replay FILE.

      .venv/bin/python -m benchmarks.fuzz_long --atheris --target frames --minutes 10
      .venv/bin/python -m benchmarks.fuzz_long --atheris --target all --minutes 30
      .venv/bin/python -m benchmarks.fuzz_long --atheris --target safetensors \\
          --replay var/fuzz/safetensors/crash-...

Targets: frames (decode_request), generate (unpack, then Engine.submit), safetensors
(parse_bytes, checked against the reference reader), adapter (inspect_adapter on a
directory whose adapter_config.json and adapter_model.safetensors come from the input),
diffs (unpack, then body_of_diff and apply, and the heartbeat schema). Open bugs listed in KNOWN_BUGS are stepped
over, as in `make test`; --strict makes them fail again.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
TARGETS = ("frames", "generate", "safetensors", "adapter", "diffs")
OUT = REPO / "var" / "fuzz"


# ---- Hypothesis ----------------------------------------------------------------------------

def hypothesis_rounds(minutes: float, examples: int, keep_going: bool) -> int:
    deadline = time.monotonic() + minutes * 60
    failures = 0
    rounds = 0
    while time.monotonic() < deadline:
        seed = random.randrange(2**32)
        rounds += 1
        print(f"round {rounds}: {examples} examples per property, --hypothesis-seed={seed}",
              flush=True)
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/property/test_fuzz.py", "-k", "not regression", f"--hypothesis-seed={seed}",
             "--hypothesis-show-statistics"],
            cwd=REPO, env={**os.environ, "LORAPLANE_FUZZ_EXAMPLES": str(examples)})
        if res.returncode != 0:
            failures += 1
            print(f"round {rounds} FAILED; replay: LORAPLANE_FUZZ_EXAMPLES={examples} "
                  f".venv/bin/python -m pytest tests/property/test_fuzz.py --hypothesis-seed={seed}",
                  flush=True)
            if not keep_going:
                break
    print(f"{rounds} round(s), {failures} failed")
    return 1 if failures else 0


# ---- atheris -------------------------------------------------------------------------------

def _seeds(target: str, props: Any, example: Any) -> list[bytes]:
    """Valid inputs for `target`, so the fuzzer starts from the real formats."""
    from shared.protocol import COMMANDS, encode_request, pack
    from shared.reducer import diff_of
    from shared.replica_protocol import generate_args
    weights = [(d / "adapter_model.safetensors").read_bytes()
               for d in example.adapter_dirs.values()]
    if target == "frames":
        return [encode_request("r", cmd, {}) for cmd in COMMANDS] + [
            encode_request("r", "events", {"since": 1, "limit": 5}),
            encode_request("r", "unload", {"event_id": "0b7e4f9e-3c1a-4f7e-9a52-1f0c2d3e4b5a",
                                           "name": "a"})]
    if target == "generate":
        return [pack(generate_args([1, 2, 3], max_new_tokens=4, temperature=0.5, top_p=0.9,
                                   seed=7, stop_token_ids=[2], adapter="a"))]
    if target == "safetensors":
        return [w[:4096] for w in weights] + weights[:1]
    if target == "adapter":
        return [_adapter_input((d / "adapter_config.json").read_bytes(),
                               (d / "adapter_model.safetensors").read_bytes())
                for d in example.adapter_dirs.values()]
    state, bases = props.diff_cases(props.example_pool(example.model_dir))
    return [pack(b) for b in bases] + [pack(diff_of(9, state.adapters["a"], log_id=props.LOG_ID)),
                                       pack(props.HEARTBEAT)]


def _adapter_input(config: bytes, weights: bytes) -> bytes:
    return struct.pack("<I", len(config)) + config + weights


def _split_adapter_input(data: bytes) -> tuple[bytes, bytes]:
    n = struct.unpack("<I", data[:4])[0] if len(data) >= 4 else 0
    return data[4:4 + n], data[4 + n:]


def void(_: Any) -> None:
    return None


def _oracle(target: str, props: Any, example: Any, scratch: Path) -> Callable[[bytes], None]:
    """A function of the input bytes that runs the target's oracle (atheris wants None back)."""
    from shared.protocol import ProtocolError, unpack

    def unpacked(data: bytes) -> Any:
        try:
            return unpack(data)
        except ProtocolError:
            return None

    if target == "frames":
        return lambda data: void(props.check_frame(data))
    if target == "safetensors":
        return lambda data: void(props.check_tensor_file(data))
    if target == "generate":
        return lambda data: void(props.check_submit(unpacked(data)))
    if target == "diffs":  # the diff stream: each input read as a diff and as a heartbeat
        state, _ = props.diff_cases(props.example_pool(example.model_dir))

        def stream(data: bytes) -> None:
            msg = unpacked(data)
            props.check_diff(msg, state)
            props.check_heartbeat(msg)
        return stream
    pool = props.example_pool(example.model_dir)
    adapter = scratch / "adapter"
    adapter.mkdir()

    def check(data: bytes) -> None:
        config, weights = _split_adapter_input(data)
        (adapter / "adapter_config.json").write_bytes(config)
        (adapter / "adapter_model.safetensors").write_bytes(weights)
        props.check_adapter(adapter, pool)

    return check


def run_atheris(target: str, minutes: float, input_timeout: int, strict: bool,
                replay: Path | None) -> int:
    try:
        import atheris
    except ImportError:
        print("atheris is not installed: .venv/bin/pip install atheris (CPython 3.11 wheels "
              "exist for Linux x86_64; elsewhere it needs clang and libFuzzer)",
              file=sys.stderr)
        return 2
    # instrument this project's modules only: coverage feedback where the decoders are
    with atheris.instrument_imports(include=["shared", "statesvc", "computed"]):
        import computed.serving.engine  # noqa: F401
        import shared.protocol  # noqa: F401
        import shared.reducer  # noqa: F401
        import shared.tensorfile  # noqa: F401
        import statesvc.adapters  # noqa: F401
    from statesvc.tools.example import make_example
    from testkit import fuzz_oracles as props
    props.STEP_OVER_KNOWN_BUGS = not strict

    scratch = Path(tempfile.mkdtemp(prefix=f"fuzz-{target}-"))
    example = make_example(scratch / "example", seed=0)
    oracle = _oracle(target, props, example, scratch)
    if replay is not None:
        oracle(replay.read_bytes())
        print(f"{replay}: no failure")
        return 0
    out = OUT / target
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    if not any(corpus.iterdir()):
        for i, seed in enumerate(_seeds(target, props, example)):
            (corpus / f"seed-{i}").write_bytes(seed)
    args = [sys.argv[0], str(corpus), f"-max_total_time={int(minutes * 60)}",
            f"-timeout={input_timeout}", "-rss_limit_mb=4096", f"-artifact_prefix={out}/",
            "-max_len=65536", "-print_final_stats=1"]
    print(f"atheris on {target} for {minutes:g} min; corpus {corpus}", flush=True)
    atheris.Setup(args, oracle)
    try:
        atheris.Fuzz()  # exits the process when done or at the first failure
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="total time [30]")
    ap.add_argument("--examples", type=int, default=2000,
                    help="Hypothesis examples per property per round [2000]")
    ap.add_argument("--keep-going", action="store_true",
                    help="Hypothesis: start another round after a failed one")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided, with atheris")
    ap.add_argument("--target", choices=TARGETS + ("all",), default="all",
                    help="atheris: the decoder to fuzz [all]")
    ap.add_argument("--input-timeout", type=int, default=10,
                    help="atheris: seconds one input may take before it counts as a hang [10]")
    ap.add_argument("--strict", action="store_true",
                    help="atheris: fail on the open bugs of KNOWN_BUGS too")
    ap.add_argument("--replay", type=Path, help="atheris: run one saved input and exit")
    a = ap.parse_args()
    if not a.atheris:
        return hypothesis_rounds(a.minutes, a.examples, a.keep_going)
    if a.target != "all":
        return run_atheris(a.target, a.minutes, a.input_timeout, a.strict, a.replay)
    worst = 0
    for target in TARGETS:  # each in its own process: atheris.Fuzz() ends the process
        cmd = [sys.executable, "-m", "benchmarks.fuzz_long", "--atheris", "--target", target,
               "--minutes", str(a.minutes / len(TARGETS)),
               "--input-timeout", str(a.input_timeout)] + (["--strict"] if a.strict else [])
        rc = subprocess.run(cmd, cwd=REPO).returncode
        print(f"{target}: exit {rc}", flush=True)
        worst = max(worst, rc)
    return worst


if __name__ == "__main__":
    sys.exit(main())
