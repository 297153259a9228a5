"""Every served family (issue 38) gives what transformers + PEFT give, on checkpoints and adapters
that transformers and PEFT wrote themselves.

For each family a tiny random checkpoint with shapes unlike the example's (GQA, a head_dim that
is not hidden / heads, three layers, so local and global layers alternate, sliding windows
shorter than the prompts) is saved by transformers' own `save_pretrained`, with two PEFT
adapters saved by PEFT (every module at rank 8; attention at rank 4 with rsLoRA). Each
family's options are set away from their defaults where the family has them (soft-caps small
enough that tanh bends the scores, Granite's four multipliers, Gemma 3's two RoPE bases with
linear scaling on the global one, yarn and dynamic RoPE, Qwen2's sliding layers).

Checked, float32, on both backends (native kernels and portable XLA): PEFT's mixed-batch logits
of a whole sequence; each request alone through prefill and the KV cache (greedy tokens equal,
every step's logits within the Llama tests' 1e-4 of the logit scale); the three requests decoded
together as one mixed batch. bfloat16: the first step's logits against transformers' own
bfloat16 model within 5e-2 of the logit scale (the agreement measured is printed).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from computed.model import lora  # noqa: E402
from computed.backend import XlaBackend, native  # noqa: E402
from computed.model.loader import load_model, with_layout  # noqa: E402
from computed.model.params import DecoderParams  # noqa: E402
from computed.model.runner import decode, forward_full, init_cache, prefill, prefill_batch  # noqa: E402
from computed.residency.pool import MemoryPool, PoolSpec  # noqa: E402
from shared.projections import ATTN_MODULES, MODULES  # noqa: E402
from testkit.fleet import StateSvc, loractl  # noqa: E402
from tests.helpers import adapter_weights, one_torch_thread  # noqa: E402,F401 (autouse)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

RTOL = 1e-4
BF16_RTOL = 5e-2
NEW_TOKENS = 6
MAX_LEN = 64
BUCKET = 32
LENGTHS = (13, 9, 17)  # prompts longer than every sliding window below

# two layers: every per-layer choice below still comes in both kinds (Gemma's and Qwen2's sliding
# and full layers, Qwen3-MoE's sparse and dense MLP), and the second layer reads the first's output;
# each layer is a copy in the compiled program, so a third only added compile time
SHAPE = dict(vocab_size=96, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2, head_dim=12, max_position_embeddings=128)
# model_type -> (config class, options away from the defaults)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                  tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", dict(sliding_window=5, max_position_embeddings=32,
                                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                       "factor": 2.0})),
    "gemma2": ("Gemma2Config", dict(sliding_window=6, query_pre_attn_scalar=16, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=4.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        sliding_window=6, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "olmo2": ("Olmo2Config", dict()),
    "granite": ("GraniteConfig", dict(embedding_multiplier=6.0, attention_multiplier=0.15,
                                      residual_multiplier=0.4, logits_scaling=3.0)),
    # experts of another size than the dense MLP; Qwen3-MoE with a dense layer after a sparse one
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
}
MOE = ("mixtral", "qwen3_moe")  # LoRA on attention only (the experts': refused, docs/adapters.md)
ADAPTERS = {"all-r8": dict(r=8, lora_alpha=16, target_modules=list(MODULES)),
            "attn-rs-r4": dict(r=4, lora_alpha=8, target_modules=list(ATTN_MODULES), use_rslora=True)}


@dataclass
class Family:
    model_dir: Path
    adapter_dirs: dict[str, Path]
    config: Any
    params: DecoderParams            # as this machine's backend lays them out
    pool: MemoryPool
    slots: dict[str, int]
    ref: Any                       # PeftModel, float32, every adapter loaded
    _greedy: dict[tuple[tuple[int, ...], str | None], tuple[list[int], np.ndarray]]

    def slot(self, adapter: str | None) -> int:
        return lora.BASE if adapter is None else self.slots[adapter]

    def logits(self, tokens: np.ndarray, adapters: list[str | None]) -> np.ndarray:
        return peft_logits(self.ref, tokens, adapters)

    def greedy(self, prompt: list[int], adapter: str | None) -> tuple[list[int], np.ndarray]:
        key = (tuple(prompt), adapter)
        if key not in self._greedy:
            self._greedy[key] = peft_greedy(self.ref, prompt, adapter, NEW_TOKENS)
        return self._greedy[key]


def peft_logits(ref: Any, tokens: np.ndarray, adapters: list[str | None]) -> np.ndarray:
    """`reference`'s logits [rows, positions, vocab] for a batch, row i through adapters[i] (None: the base)."""
    names = ["__base__" if a is None else a for a in adapters]
    with torch.no_grad():
        return ref(torch.tensor(tokens, dtype=torch.long), adapter_names=names).logits.float().numpy()


def peft_greedy(ref: Any, prompt: list[int], adapter: str | None, new_tokens: int) -> tuple[list[int], np.ndarray]:
    """`reference`'s greedy continuation of `prompt` and the last position's logits at each step."""
    seq, steps = list(prompt), []
    for _ in range(new_tokens):
        last = peft_logits(ref, np.array([seq]), [adapter])[0, -1]
        steps.append(last)
        seq.append(int(np.argmax(last)))
    return seq[len(prompt):], np.stack(steps)


def write_family(root: Path, family: str, dtype: Any = None) -> tuple[Path, dict[str, Path]]:
    """A random checkpoint of `family` and two adapters, saved by transformers and PEFT."""
    cls, options = FAMILIES[family]
    torch.manual_seed(sum(map(ord, family)))
    config = getattr(transformers, cls)(**{**SHAPE, **options}, initializer_range=0.25)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1 (Gemma's away from 0): their weights are exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.3 * torch.randn_like(p))
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    dirs = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        if family in MOE:
            spec = {**spec, "target_modules": [m for m in spec["target_modules"] if m in ATTN_MODULES]}
        tuned = peft.get_peft_model(base, peft.LoraConfig(**spec, init_lora_weights=False))
        with torch.no_grad():
            for pname, p in tuned.named_parameters():
                if "lora_" in pname:
                    p.copy_(0.1 * torch.randn_like(p))
        tuned.save_pretrained(root / name)
        dirs[name] = root / name
    return model_dir, dirs


def reference(model_dir: Path, adapter_dirs: dict[str, Path], dtype: Any) -> Any:
    moe = json.loads((model_dir / "config.json").read_text())["model_type"] in MOE
    # the experts as modeling_*.py writes them (a loop over the experts), not a grouped-GEMM kernel
    extra = {"experts_implementation": "eager"} if moe else {}
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager",
                                                             **extra)
    names = list(adapter_dirs)
    model = peft.PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    return model.eval()


def fill_pool(adapter_dirs: dict[str, Path], config: Any, dtype: str = "float32") -> tuple[MemoryPool, dict[str, int]]:
    spec = PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                    slots=len(adapter_dirs) + 1, max_rank=8, dtype=dtype)
    pool, slots = MemoryPool(spec), {}
    for i, (name, path) in enumerate(adapter_dirs.items()):
        assert pool.write_slot(i + 1, adapter_weights(path, i + 1))
        slots[name] = i + 1
    return pool, slots


_BUILT: dict[str, Family] = {}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name = request.param
    if name not in _BUILT:
        model_dir, dirs = write_family(tmp_path_factory.mktemp(name), name)
        config, params = load_model(model_dir)
        assert config.model_type == name
        pool, slots = fill_pool(dirs, config)
        _BUILT[name] = Family(model_dir, dirs, config, params, pool, slots,
                              reference(model_dir, dirs, torch.float32), {})
    return _BUILT[name]


def close(ours: Any, ref: np.ndarray, rtol: float = RTOL) -> float:
    ours = np.asarray(ours, np.float32)
    diff = float(np.abs(ours - ref).max()) / float(np.abs(ref).max())
    assert diff <= rtol, f"logits differ by {diff:.2e} of the logit scale (limit {rtol:.0e})"
    return diff


def prompts(fam: Family) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, fam.config.vocab_size, n).tolist() for n in LENGTHS]


def padded(prompt: list[int]) -> np.ndarray:
    out = np.zeros(BUCKET, np.int32)
    out[:len(prompt)] = prompt
    return out


def backend_params(fam: Family, backend: str) -> DecoderParams:
    if backend == "xla":
        return with_layout(fam.params, XlaBackend())
    if not native.available():
        pytest.skip(f"the native kernels are not built here: {native.unavailable_reason()}")
    return fam.params


@pytest.mark.parametrize("backend", ["native", "xla"])
def test_family_matches_transformers_and_peft(family: Family, backend: str) -> None:
    fam, params = family, backend_params(family, backend)
    adapters: list[str | None] = [None, *fam.adapter_dirs]
    # a whole sequence, PEFT's mixed batch against ours
    tokens = np.random.default_rng(7).integers(0, fam.config.vocab_size, (len(adapters), 15))
    ref = fam.logits(tokens, adapters)
    close(forward_full(params, fam.pool.arrays, tokens, [fam.slot(a) for a in adapters]), ref)
    assert np.abs(ref[1] - ref[0]).max() > 100 * RTOL * np.abs(ref).max()  # the LoRA term is there

    # each request alone, through prefill and the cache
    cache = init_cache(fam.config, 3, MAX_LEN, blocked=backend == "native")
    want = [fam.greedy(p, a) for p, a in zip(prompts(fam), adapters)]
    for row, (prompt, adapter) in enumerate(zip(prompts(fam), adapters)):
        want_tokens, want_logits = want[row]
        logits, cache = prefill(params, fam.pool.arrays, cache, padded(prompt), len(prompt), row, fam.slot(adapter))
        close(logits, want_logits[0])
        got, active = [int(np.argmax(logits))], np.arange(3) == row
        for step in range(1, NEW_TOKENS):
            out, cache = decode(params, fam.pool.arrays, cache, np.where(active, got[-1], 0),
                                np.where(active, len(prompt) + step - 1, 0),
                                np.where(active, fam.slot(adapter), lora.BASE), active)
            close(out[row], want_logits[step])
            got.append(int(np.argmax(out[row])))
        assert got == want_tokens, f"{fam.config.model_type} {adapter}: greedy tokens differ"

    # the three together: one batched prefill, then mixed-adapter decode steps
    cache = init_cache(fam.config, 3, MAX_LEN, blocked=backend == "native")
    lengths = np.array(LENGTHS)
    slots = np.array([fam.slot(a) for a in adapters])
    logits, cache = prefill_batch(params, fam.pool.arrays, cache, np.stack([padded(p) for p in prompts(fam)]),
                                  lengths, np.arange(3), slots)
    got_rows = [[int(np.argmax(row))] for row in logits]
    active = np.ones(3, bool)
    for step in range(1, NEW_TOKENS):
        out, cache = decode(params, fam.pool.arrays, cache, np.array([g[-1] for g in got_rows]),
                            lengths + step - 1, slots, active)
        for b in range(3):
            close(out[b], want[b][1][step])
            got_rows[b].append(int(np.argmax(out[b])))
    assert got_rows == [w[0] for w in want], "mixed batch: greedy tokens differ"


def test_family_in_bfloat16_is_close_to_transformers_bfloat16(family: Family) -> None:
    fam = family
    config, params = load_model(fam.model_dir, "bfloat16")
    pool, slots = fill_pool(fam.adapter_dirs, config, "bfloat16")
    ref = reference(fam.model_dir, fam.adapter_dirs, torch.bfloat16)
    adapters: list[str | None] = [None, *fam.adapter_dirs]
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, (len(adapters), 15))
    names = ["__base__" if a is None else a for a in adapters]
    with torch.no_grad():
        want = ref(torch.tensor(tokens), adapter_names=names).logits.float().numpy()
    exact = fam.logits(tokens, adapters)  # float32
    ours = np.asarray(forward_full(params, pool.arrays, tokens,
                                   [lora.BASE if a is None else slots[a] for a in adapters]))
    scale = float(np.abs(exact).max())
    ours_err, theirs_err = (float(np.abs(x - exact).max()) / scale for x in (ours, want))
    agree = float(np.mean(np.argmax(ours, -1) == np.argmax(want, -1)))
    print(f"{config.model_type} bfloat16: ours {ours_err:.2e} and transformers' {theirs_err:.2e} of the logit "
          f"scale from float32; argmax agrees with transformers' bfloat16 at {agree:.0%}")
    # as close to the float32 model as transformers' own bfloat16 model is, give or take rounding
    assert ours_err <= max(2 * theirs_err, BF16_RTOL), (ours_err, theirs_err)
    assert json.loads((fam.model_dir / "config.json").read_text())["model_type"] == config.model_type


@pytest.mark.parametrize("name", MOE)
def test_moe_pool_holds_attention_lora_and_refuses_lora_on_experts(name: str, tmp_path: Path) -> None:
    """Through real statesvc and loractl: a MoE pool's targets are its attention projections; an
    adapter PEFT saved with LoRA on the experts (PEFT 0.21 turns target_modules on a MoE's MLP
    into target_parameters on the stacked experts) is refused naming what to retrain, and so is
    a pool asking for MLP targets; nothing of either is appended."""
    model_dir, dirs = write_family(tmp_path / "family", name)
    torch.manual_seed(9)
    tuned = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(model_dir),
                                peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                target_modules=["q_proj", *(("w1", "w3") if name == "mixtral" else ("gate_proj", "up_proj"))]))
    tuned.save_pretrained(tmp_path / "experts")
    saved = json.loads((tmp_path / "experts" / "adapter_config.json").read_text())
    assert saved["target_parameters"], saved  # LoRA on the experts, as PEFT writes it
    svc = StateSvc(tmp_path / "data")
    try:
        svc.start()
        init = ["pool", "init", "--model", str(model_dir), "--max-loras", "2", "--max-rank", "8", "--json"]
        mlp = loractl(svc, *init, "--targets", "q_proj,gate_proj", check=False)
        assert mlp.returncode == 1 and "(bad_request)" in mlp.stderr, mlp.stderr
        assert "mixture of experts" in mlp.stderr and "q_proj, k_proj, v_proj, o_proj" in " ".join(mlp.stderr.split())
        pool = json.loads(loractl(svc, *init, "--targets", "all").stdout)
        assert pool["targets"] == list(ATTN_MODULES)
        refused = loractl(svc, "load", "experts", str(tmp_path / "experts"), check=False)
        assert refused.returncode == 1 and "(unsupported)" in refused.stderr, refused.stderr
        said = " ".join(refused.stderr.split())
        assert "experts" in said and "retrain with target_modules on attention" in said, said
        assert json.loads(loractl(svc, "load", "attn", str(dirs["all-r8"]), "--json").stdout)["seq"] == 2
        events = json.loads(loractl(svc, "events", "--json").stdout)
        assert [e["type"] for e in events] == ["pool.configured", "adapter.loaded"]
    finally:
        svc.stop()


def test_family_in_chunks_matches_transformers_and_peft(family: Family) -> None:
    """Prompts of 40 tokens (past every sliding window) prefilled 16 tokens a step, each chunk
    attending over its row's cache (the path of chunked prefill and of prefix-cache hits,
    computed/serving/prefill.py), then decoded as one mixed batch: PEFT's greedy tokens. A
    model with dynamic RoPE runs no chunks (its tables depend on each forward's length). On the
    backend serving picks (the chunk's attention is XLA's on both)."""
    from computed.model.runner import Runner
    fam = family
    params = backend_params(fam, "native" if native.available() else "xla")
    runner = Runner(fam.config, params, max_batch=3, max_len=MAX_LEN, extend=True)
    if not Runner.chunkable(fam.config):
        assert not runner.extend
        return
    adapters: list[str | None] = [None, *fam.adapter_dirs]
    rng = np.random.default_rng(11)
    long = [rng.integers(0, fam.config.vocab_size, 40).tolist() for _ in adapters]
    slots = [fam.slot(a) for a in adapters]
    cache = runner.new_cache()
    for start in (0, 16, 32):
        logits, cache = runner.prefill(fam.pool.arrays, cache, [p[:start + 16] for p in long], [0, 1, 2], slots,
                                       starts=[start] * 3)
    want = [fam.greedy(p, a) for p, a in zip(long, adapters)]
    got_rows = [[int(np.argmax(row))] for row in logits]
    for b in range(3):
        close(logits[b], want[b][1][0])
    for step in range(1, NEW_TOKENS):
        out, cache = runner.decode(fam.pool.arrays, cache, np.array([g[-1] for g in got_rows]),
                                   np.full(3, 40 + step - 1), np.array(slots), np.ones(3, bool))
        for b in range(3):
            close(out[b], want[b][1][step])
            got_rows[b].append(int(np.argmax(out[b])))
    assert got_rows == [w[0] for w in want], f"{fam.config.model_type} in chunks: greedy tokens differ"
