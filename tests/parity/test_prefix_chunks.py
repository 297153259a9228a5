"""A prompt prefilled in chunks, or from a prefix's KV copied out of the block store, gives what
transformers + PEFT give: the first logits within 1e-4 of the logit scale and the greedy
continuation token for token, on both K layouts (the attention kernel's, XLA's)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.parity.test_model_parity import (MAX_LEN, NEW_TOKENS, Setup, close, make_setup,  # noqa: F401
                                            one_torch_thread, prompt_of)

from computed.model import lora  # noqa: E402
from computed.model.runner import Runner, decode, init_cache  # noqa: E402
from statesvc.tools.example import ExampleAssets  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

MAX_BATCH = 4


@pytest.fixture(scope="module")
def chunk_setup(example: ExampleAssets) -> Setup:
    return make_setup(example)


def runner_of(setup: Setup, impl: str) -> Runner:
    params = setup.params if impl == "kernels" else setup.unpacked()
    return Runner(setup.config, params, max_batch=MAX_BATCH, max_len=MAX_LEN, extend=True)


def greedy_from(setup: Setup, runner: Runner, cache, first: np.ndarray, rows: list[int],
                lengths: list[int], slots: list[int]) -> list[list[int]]:
    """NEW_TOKENS greedy tokens per row, decoded through the cache from each row's first logits."""
    out = [[int(np.argmax(first[i]))] for i in range(len(rows))]
    row_slots = np.full(MAX_BATCH, lora.BASE, np.int32)
    row_slots[rows] = slots
    active = np.zeros(MAX_BATCH, bool)
    active[rows] = True
    for step in range(1, NEW_TOKENS):
        tokens = np.zeros(MAX_BATCH, np.int32)
        positions = np.zeros(MAX_BATCH, np.int32)
        for i, r in enumerate(rows):
            tokens[r], positions[r] = out[i][-1], lengths[i] + step - 1
        logits, cache = runner.decode(setup.pool.arrays, cache, tokens, positions, row_slots, active)
        for i, r in enumerate(rows):
            out[i].append(int(np.argmax(logits[r])))
    return out


@pytest.mark.parametrize("impl", ["kernels", "xla"])
def test_a_prompt_in_chunks_equals_peft(chunk_setup: Setup, impl: str) -> None:
    """Three prompts of other adapters and the base model, each prefilled 16 tokens at a time
    (the later chunks continue their rows from positions 16, 32, ...; the last is partial)."""
    setup = chunk_setup
    names = [a.name for a in setup.assets.adapters]
    adapters = [names[0], None, names[-1]]
    lengths = [41, 33, 50]
    prompts = [prompt_of(setup, 70 + i, n) for i, n in enumerate(lengths)]
    rows, slots = [2, 0, 3], [setup.slot(a) for a in adapters]
    runner = runner_of(setup, impl)
    cache = runner.new_cache()
    first = np.zeros((3, setup.config.vocab_size), np.float32)
    for start in range(0, max(lengths), 16):
        live = [i for i in range(3) if start < lengths[i]]
        logits, cache = runner.prefill(setup.pool.arrays, cache, [prompts[i][:start + 16] for i in live],
                                       [rows[i] for i in live], [slots[i] for i in live],
                                       starts=[start] * len(live))
        for j, i in enumerate(live):
            first[i] = logits[j]
    want = [setup.ref.greedy(p, a) for p, a in zip(prompts, adapters)]
    for i in range(3):
        close(first[i], want[i][1][0])
    assert greedy_from(setup, runner, cache, first, rows, lengths, slots) == [w[0] for w in want]


@pytest.mark.parametrize("impl", ["kernels", "xla"])
def test_a_prefix_from_the_block_store_equals_peft(chunk_setup: Setup, impl: str) -> None:
    """Row 0 prefills a prompt and its first three blocks go to the store (out of order, among
    padding); two prompts sharing 48 and 16 of those tokens load them into other rows and
    prefill only the rest. A chunk that would run past max_len starts earlier."""
    setup = chunk_setup
    name = setup.assets.adapters[0].name
    slot = setup.slot(name)
    shared = prompt_of(setup, 90, 52)
    runner = runner_of(setup, impl)
    cache = runner.new_cache()
    store = runner.new_blocks(8)
    _, cache = runner.prefill(setup.pool.arrays, cache, [shared], [0], [slot])
    store = runner.save_blocks(store, cache, 0, [0, 1, 2], [5, 2, 7])
    cache = init_cache(setup.config, MAX_BATCH, MAX_LEN, blocked=runner.params.backend.blocked)  # rows wiped
    prompts = [shared[:48] + prompt_of(setup, 91, 7), shared[:16] + prompt_of(setup, 92, 40)]
    cache = runner.load_blocks(cache, store, 1, [5, 2, 7])
    cache = runner.load_blocks(cache, store, 3, [5])
    # the second's rest (40 tokens) takes a 64-token bucket: from 16 it would end at 80, past
    # max_len 64, so it starts at 0
    first, cache = runner.prefill(setup.pool.arrays, cache, prompts, [1, 3], [slot, slot], starts=[48, 16])
    want = [setup.ref.greedy(p, name) for p in prompts]
    for i in range(2):
        close(first[i], want[i][1][0])
    assert greedy_from(setup, runner, cache, first, [1, 3], [len(p) for p in prompts],
                       [slot, slot]) == [w[0] for w in want]
