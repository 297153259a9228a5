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
from typing import Any

import pytest

from statesvc.tools.example import ExampleAssets
from tests.helpers import Fleet

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
TASKS = ("lp_mc", "lp_gen")
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


def lm_eval(root: Path, tasks: Path, jobs: dict[str, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """lm-eval's evaluation of each job ({key: (model, model_args)}) on both tasks, all in one
    process (tests/integration/lm_eval_runner.py: the CLI's `simple_evaluate`): {key: {"results":
    metrics per task, "samples": each task's samples' filtered responses, by doc_id}}."""
    spec = {"tasks": str(tasks), "names": list(TASKS),
            "jobs": [{"model": m, "model_args": a, "out": str(root / f"{key}.json")}
                     for key, (m, a) in jobs.items()]}
    (root / "jobs.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "tests.integration.lm_eval_runner", str(root / "jobs.json")]
    proc = subprocess.run(cmd, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {key: json.loads((root / f"{key}.json").read_text()) for key in jobs}


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> dict[str, dict[str, Any]]:
    """lm-eval's `hf` model (with `peft=` for the adapter) and its `local-completions` model against
    a gateway over statesvc and one replica serving the same checkpoint, base and adapter."""
    root = tmp_path_factory.mktemp("lm-eval")
    tasks = write_tasks(root)
    model_dir = example.model_dir
    fleet = Fleet(root, example)
    try:
        fleet.serving({ADAPTER[0]: ADAPTER[1]}, args=("--max-batch", "4", "--max-len", "64"), warm=True)
        url = fleet.gateway().url
        jobs = {}
        for key, adapter in (("base", None), ("adapter", ADAPTER)):
            hf_args = f"pretrained={model_dir},dtype=float32"
            if adapter is not None:
                hf_args += f",peft={example.adapter_dirs[adapter[1]]}"
            name = model_dir.name if adapter is None else adapter[0]
            jobs[f"hf-{key}"] = ("hf", hf_args)
            jobs[f"api-{key}"] = ("local-completions", (
                f"model={name},base_url={url}/v1/completions,tokenizer={model_dir},"
                "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=64"))
        return lm_eval(root, tasks, jobs)
    finally:
        fleet.stop()


@pytest.mark.parametrize("key", ["base", "adapter"])
def test_local_completions_gives_the_metrics_of_hf(evaluations: dict[str, dict[str, Any]], key: str) -> None:
    want, got = evaluations[f"hf-{key}"], evaluations[f"api-{key}"]
    for task, metrics in (("lp_mc", ("acc,none", "acc_norm,none")), ("lp_gen", ("exact_match,none",))):
        for m in metrics:
            assert got["results"][task][m] == pytest.approx(want["results"][task][m]), (task, m)
    # per sample: each choice's loglikelihood, and the generations exactly
    for ours, theirs in zip(got["samples"]["lp_mc"], want["samples"]["lp_mc"], strict=True):
        assert [float(x[0]) for x in ours] == pytest.approx([float(x[0]) for x in theirs], abs=2e-3)
    assert got["samples"]["lp_gen"] == want["samples"]["lp_gen"]
    assert any(g != [""] for g in got["samples"]["lp_gen"])  # the generations are not all empty
