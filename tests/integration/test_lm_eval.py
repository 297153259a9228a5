"""lm-evaluation-harness as a real client: `--model local-completions` against the gateway gives
the metrics (and the per-sample loglikelihoods and generations) of `--model hf` (with `peft=` for
an adapter) on the same checkpoint. Two local tasks over JSON files written here, nothing
downloaded: a multiple_choice one (loglikelihood: echo + logprobs, docs/gateway.md) and a
generate_until one (greedy, short)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from statesvc.tools.example import ExampleAssets
from testkit.fleet import wait_for
from tests.helpers import WARMUP_TIMEOUT_S, Fleet

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("lm_eval")

pytestmark = pytest.mark.timeout(900)
ADAPTER = ("code", "all-r2")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}

MC = [{"question": q, "choices": c, "label": i % len(c)} for i, (q, c) in enumerate([
    ("The sky is", ["blue", "green", "made of cheese"]),
    ("Two plus two is", ["four", "five", "a fish"]),
    ("Water boils at", ["one hundred degrees", "zero degrees", "noon"]),
    ("A cat says", ["meow", "woof", "moo"]),
    ("The sun rises in the", ["east", "west", "north"]),
    ("Ice is", ["cold", "hot", "loud"]),
])]
GEN = [{"prompt": p, "answer": a} for p, a in [
    ("Once upon a", " time"), ("The capital of France is", " Paris"), ("One, two,", " three"),
    ("Hello,", " world"), ("Roses are", " red")]]


def task_yaml(name: str, data: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


def write_tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows in (("mc", MC), ("gen", GEN)):
        (root / f"{name}.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tasks / "lp_mc.yaml").write_text(task_yaml("lp_mc", root / "mc.json", (
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")))
    (tasks / "lp_gen.yaml").write_text(task_yaml("lp_gen", root / "gen.json", (
        "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 5\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")))
    return tasks


def lm_eval(out: Path, tasks: Path, model: str, model_args: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Run lm-eval's CLI: (its results per task, each task's samples' filtered responses)."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
           "--tasks", "lp_mc,lp_gen", "--include_path", str(tasks), "--batch_size", "1",
           "--output_path", str(out), "--log_samples", "--seed", "0", "--device", "cpu"]
    proc = subprocess.run(cmd, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (results,) = out.rglob("results_*.json")
    samples = {}
    for task in ("lp_mc", "lp_gen"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["doc_id"])
        samples[task] = [r["filtered_resps"] for r in rows]
    return json.loads(results.read_text())["results"], samples


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> Iterator[str]:
    fleet = Fleet(tmp_path_factory.mktemp("lm-eval"), example)
    try:
        fleet.statesvc.start()
        fleet.init()
        fleet.load(*ADAPTER)
        replica = fleet.replica("r1", args=("--max-batch", "4", "--max-len", "64"))
        wait_for(lambda: replica.status()["inference"]["warm"], what="warm-up", timeout=WARMUP_TIMEOUT_S)
        yield fleet.gateway().url
    finally:
        fleet.stop()


@pytest.mark.parametrize("adapter", [None, ADAPTER])
def test_local_completions_gives_the_metrics_of_hf(tmp_path: Path, example: ExampleAssets, gateway_url: str,
                                                   adapter: tuple[str, str] | None) -> None:
    tasks = write_tasks(tmp_path)
    model_dir = example.model_dir
    hf_args = f"pretrained={model_dir},dtype=float32"
    if adapter is not None:
        hf_args += f",peft={example.adapter_dirs[adapter[1]]}"
    name = model_dir.name if adapter is None else adapter[0]
    api_args = (f"model={name},base_url={gateway_url}/v1/completions,tokenizer={model_dir},"
                "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=64")
    want, want_samples = lm_eval(tmp_path / "hf", tasks, "hf", hf_args)
    got, got_samples = lm_eval(tmp_path / "api", tasks, "local-completions", api_args)
    for task, metrics in (("lp_mc", ("acc,none", "acc_norm,none")), ("lp_gen", ("exact_match,none",))):
        for m in metrics:
            assert got[task][m] == pytest.approx(want[task][m]), (task, m)
    # per sample: each choice's loglikelihood, and the generations exactly
    for ours, theirs in zip(got_samples["lp_mc"], want_samples["lp_mc"]):
        assert [float(x[0]) for x in ours] == pytest.approx([float(x[0]) for x in theirs], abs=2e-3)
    assert got_samples["lp_gen"] == want_samples["lp_gen"]
    assert any(g != [""] for g in got_samples["lp_gen"])  # the generations are not all empty
