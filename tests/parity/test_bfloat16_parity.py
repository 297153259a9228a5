"""A bfloat16 model against transformers + PEFT run in bfloat16 (torch bfloat16 on the CPU).

Both sides hold bfloat16 weights and bfloat16 activations and residual, and round every
projection's float32 sums to bfloat16 (transformers' Linear on the CPU; ours: the dense kernel's
float32 sums, or XLA's dot); both take RMSNorm and softmax in float32 and round the logits to
bfloat16. They still round at different points (RoPE, the attention's sums, the LoRA term's
order), so they agree to bfloat16's precision, not bit for bit.

The bound: max |ours - ref| <= BF16_BOUND * max |ref| per step, BF16_BOUND = 2^-5: eight bfloat16
ulps at the logit scale (an ulp is 2^-8 of a value in [1, 2) x 2^e). One rounding of the logits
alone can move a logit by half an ulp; the different roundings of two layers' residual stream,
carried through the final norm and the lm_head, measured 3 ulps (median) to 6 (worst step) on
these fixtures, about what transformers' own bfloat16 forward differs from its float32 one by
(5.4 ulps on the mixed batch; ours from float32: 4.0). The bound leaves a third more than the
worst step.

Greedy tokens: a step's token must be the reference's wherever the reference's top-1 minus top-2
logit exceeds 2 x the bound (in logits, `2 * BF16_BOUND * max |ref|`): with both logits within the
bound, neither can overtake the other there. Below that margin the step is a near-tie that
bfloat16 cannot decide, and the step is not judged; decode is fed the reference's tokens
(teacher forcing), so one near-tie does not make every later step incomparable. The tiny random
model's logits are flat (median top-2 margin 7% of the logit scale), so about half the steps are
judged; the test asserts at least a third are, so a bound grown too loose to judge anything fails.
A served replica (`computed serve --dtype bfloat16`) decodes free-running, so there a step is judged
only while its output has agreed with the reference's so far.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.parity.test_model_parity import (
    NEW_TOKENS,
    OTHER_ADAPTERS,
    OTHER_SHAPE,
    Reference,
    fill_pool,
    one_torch_thread,  # noqa: F401  (autouse: the reference runs on one torch thread here too)
    padded,
)

import jax.numpy as jnp  # noqa: E402

from computed.model import lora  # noqa: E402
from computed.backend import XlaBackend, native  # noqa: E402
from computed.model.loader import load_model, with_layout  # noqa: E402
from computed.model.packed import PackedWeight  # noqa: E402
from computed.model.params import DecoderParams  # noqa: E402
from computed.model.runner import decode, forward_full, init_cache, prefill  # noqa: E402
from statesvc.tools.example import ExampleAssets, make_example  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

BF16_BOUND = 2.0 ** -5  # of the logit scale: 8 bfloat16 ulps (module docstring)
MAX_BATCH = 4
MAX_LEN = 64


class Bf16:
    def __init__(self, assets: ExampleAssets) -> None:
        self.assets = assets
        self.config, self.params = load_model(assets.model_dir, dtype="bfloat16")
        self.pool, self.slots = fill_pool(assets, self.config, dtype="bfloat16")
        self.ref = Reference(assets, dtype="bfloat16")
        self.judged = self.skipped = 0

    def slot(self, adapter: str | None) -> int:
        return lora.BASE if adapter is None else self.slots[adapter]

    def check(self, ours: object, ref: np.ndarray) -> float:
        """Logits [..., vocab] within the bound; the greedy token the reference's wherever its margin allows."""
        ours = np.asarray(ours, np.float32).reshape(-1, ref.shape[-1])
        ref = ref.reshape(-1, ref.shape[-1])
        scale = float(np.abs(ref).max())
        diff = float(np.abs(ours - ref).max()) / scale
        assert diff <= BF16_BOUND, f"logits differ by {diff:.2e} of the logit scale (bound {BF16_BOUND:.2e})"
        top2 = np.sort(ref, axis=-1)[:, -2:]
        decided = top2[:, 1] - top2[:, 0] > 2 * BF16_BOUND * scale
        assert (ours.argmax(-1) == ref.argmax(-1))[decided].all(), "a greedy token differs where the margin decides it"
        self.judged += int(decided.sum())
        self.skipped += int((~decided).sum())
        return diff


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Bf16:
    return Bf16(make_example(tmp_path_factory.mktemp("bf16-parity"), seed=0, dtype="bfloat16"))


def test_a_bfloat16_model_runs_on_its_bits(bf16: Bf16) -> None:
    """Packed for the dense kernel as bfloat16 bits where it runs, no float32 copy; the cache as the backend attends."""
    q = bf16.params.layers[0].weights["q_proj"]
    assert bf16.params.dtype == jnp.bfloat16
    if native.dense_panel():
        assert isinstance(q, PackedWeight) and q.panels.dtype == jnp.uint16
        assert q.panel == native.dense_panel(bfloat16=True)  # AVX2: 16 columns, float32's 6
    cache = init_cache(bf16.config, MAX_BATCH, MAX_LEN, dtype="bfloat16")
    assert cache.k.dtype == bf16.params.backend.cache_dtype("bfloat16")


@pytest.mark.parametrize("backend", ["native", "xla"])
def test_mixed_batch_matches_peft_in_bfloat16(bf16: Bf16, backend: str) -> None:
    """Base rows and every adapter in one batch, every position's logits; native kernels and XLA alone."""
    params: DecoderParams = bf16.params if backend == "native" else with_layout(bf16.params, XlaBackend())
    adapters: list[str | None] = [None] + [a.name for a in bf16.assets.adapters]
    tokens = np.random.default_rng(7).integers(0, bf16.config.vocab_size, (len(adapters), 11))
    ref = bf16.ref.logits(tokens, adapters)
    ours = forward_full(params, bf16.pool.arrays, tokens, [bf16.slot(a) for a in adapters])
    for row in range(len(adapters)):
        bf16.check(np.asarray(ours)[row], ref[row])


def test_a_tied_bfloat16_model_reads_its_embeddings_from_the_packed_lm_head(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tied embeddings, llama3 RoPE, full multi-head attention, rsLoRA: one copy of the embedding, packed as
    the lm_head's bfloat16 bits where the kernel runs, its columns bit-cast back for the lookups."""
    tied = Bf16(make_example(tmp_path_factory.mktemp("bf16-tied"), seed=3, shape=OTHER_SHAPE,
                             adapters=OTHER_ADAPTERS, dtype="bfloat16"))
    if native.dense_panel():
        assert tied.params.embed is None and isinstance(tied.params.lm_head, PackedWeight)
        assert tied.params.lm_head.panels.dtype == jnp.uint16
    adapters: list[str | None] = [None] + [a.name for a in tied.assets.adapters]
    tokens = np.random.default_rng(5).integers(0, tied.config.vocab_size, (len(adapters), 9))
    ref = tied.ref.logits(tokens, adapters)
    ours = np.asarray(forward_full(tied.params, tied.pool.arrays, tokens, [tied.slot(a) for a in adapters]))
    for row in range(len(adapters)):
        tied.check(ours[row], ref[row])


def test_prefill_then_decode_matches_peft_in_bfloat16(bf16: Bf16) -> None:
    """Rows with the base model and adapters share every decode step, through the KV cache, fed the
    reference's tokens; logits within the bound and greedy tokens equal wherever the margin decides."""
    names = [a.name for a in bf16.assets.adapters]
    rng = np.random.default_rng(3)
    rows = [(adapter, [int(t) for t in rng.integers(0, bf16.config.vocab_size, n)])
            for adapter, n in ((None, 5), (names[0], 12), (names[-1], 17), (names[1], 9))]
    cache = init_cache(bf16.config, MAX_BATCH, MAX_LEN, dtype="bfloat16")
    want = [bf16.ref.greedy(prompt, adapter) for adapter, prompt in rows]
    for row, (adapter, prompt) in enumerate(rows):
        logits, cache = prefill(bf16.params, bf16.pool.arrays, cache, padded(prompt), len(prompt), row,
                                bf16.slot(adapter))
        bf16.check(logits, want[row][1][0])
    slots = np.array([bf16.slot(a) for a, _ in rows], np.int32)
    active = np.ones(MAX_BATCH, bool)
    for step in range(1, NEW_TOKENS):
        tokens = np.array([w[0][step - 1] for w in want], np.int32)  # the reference's own tokens
        positions = np.array([len(p) + step - 1 for _, p in rows], np.int32)
        logits, cache = decode(bf16.params, bf16.pool.arrays, cache, tokens, positions, slots, active)
        for row in range(MAX_BATCH):
            bf16.check(logits[row], want[row][1][step])
    total = bf16.judged + bf16.skipped
    assert 3 * bf16.judged >= total, f"only {bf16.judged} of {total} steps judged"


def decided(logits: np.ndarray) -> np.ndarray:
    """Which greedy steps the reference's margin decides (module docstring)."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return np.asarray(top2[:, 1] - top2[:, 0] > 2 * BF16_BOUND * np.abs(logits).max(axis=-1))


@pytest.mark.timeout(300)
def test_a_served_bfloat16_replica_decodes_what_peft_does(bf16: Bf16, tmp_path: Path) -> None:
    """`computed serve --dtype bfloat16` (a real subprocess, the pool bfloat16 too): each request's greedy
    output is the reference's at every step the reference's margin decides, as long as the two have
    agreed so far (free-running: a near-tie that went the other way leaves the rest incomparable)."""
    from testkit.fleet import wait_for
    from tests.helpers import Fleet
    from tests.parity.test_serving import Client, generate

    fleet = Fleet(tmp_path, bf16.assets)
    fleet.statesvc.start()
    client = None
    try:
        fleet.init(max_loras=4, max_rank=32, dtype="bfloat16")
        names = [a.name for a in bf16.assets.adapters][:2]
        for name in names:
            fleet.load(name, name)
        replica = fleet.replica("r1", args=("--no-warmup", "--dtype", "bfloat16", "--max-batch", "4",
                                            "--max-len", "64"))
        wait_for(lambda: fleet.converged(replica), what="adapters applied")
        client = Client(replica.listen)
        rng = np.random.default_rng(11)
        asked = {}
        for adapter in (None, *names):
            prompt = [int(t) for t in rng.integers(0, bf16.config.vocab_size, 7)]
            asked[client.send("generate", generate(adapter, prompt, n=NEW_TOKENS))] = (adapter, prompt)
        replies = client.gather(list(asked))
        judged = 0
        for rid, (adapter, prompt) in asked.items():
            assert replies[rid]["ok"], replies[rid]
            want, logits = bf16.ref.greedy(prompt, adapter)
            got = replies[rid]["result"]["output_ids"]
            assert len(got) == NEW_TOKENS
            for step, sure in enumerate(decided(logits)):
                if sure:
                    assert got[step] == want[step], f"{adapter}: step {step} differs where the margin decides it"
                    judged += 1
                elif got[step] != want[step]:
                    break  # a near-tie went the other way: the contexts differ from here on
        assert judged >= NEW_TOKENS // 2, f"only {judged} steps decided by the margin: too few to judge"
    finally:
        if client is not None:
            client.close()
        fleet.stop()
