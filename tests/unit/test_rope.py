"""RoPE as transformers 5 computes it: every rope type's frequencies, attention scaling and cos/sin
tables against transformers' own `ROPE_INIT_FUNCTIONS` and `LlamaRotaryEmbedding`, and the configs
`read_rope` refuses, in the words it refuses them.

Frequencies agree to the bit except where torch's float32 `pow` lands one ulp from the correctly
rounded power (about 1% of them); there the tables may differ by what that ulp moves the angle
(position * ulp, plus the rounding of the product), and by 1e-6 everywhere else.
"""
from __future__ import annotations

import copy
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from computed.model.rope import attention_scaling, dynamic_inv_freq, inv_freq, rope_tables
from shared.rope import ROPE_TYPES, Rope, read_rope

HEAD_DIMS = (16, 24, 64, 128)
POSITIONS = np.arange(301)
F32 = np.float32

CASES: dict[str, tuple[dict[str, Any], int]] = {  # name: (rope_parameters, max_position_embeddings)
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 2048),
    "default 1e6": ({"rope_type": "default", "rope_theta": 1e6}, 32768),
    "default odd theta": ({"rope_type": "default", "rope_theta": 31234.7}, 4096),
    "linear 2": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, 4096),
    "linear 4.5 (4.x type key)": ({"type": "linear", "rope_theta": 500000.0, "factor": 4.5}, 4096),
    "llama3.1": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072),
    "llama3.2": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072),
    "llama3 short original": ({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                               "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                               "original_max_position_embeddings": 64}, 256),
    "dynamic at base": ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 64),
    "yarn qwen": ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                   "original_max_position_embeddings": 32768}, 131072),
    "yarn deepseek mscale": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                              "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 0.5}, 163840),
    "yarn mscale equal": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                           "original_max_position_embeddings": 4096, "mscale": 0.707,
                           "mscale_all_dim": 0.707}, 163840),
    "yarn mscale alone": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                           "original_max_position_embeddings": 4096, "mscale": 1.0,
                           "mscale_all_dim": 0}, 65536),
    "yarn attention_factor": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                               "original_max_position_embeddings": 2048, "attention_factor": 1.25}, 16384),
    "yarn untruncated": ({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                          "original_max_position_embeddings": 4096, "truncate": False,
                          "beta_fast": 16.0, "beta_slow": 2.0}, 131072),
    "yarn null factor": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
                          "original_max_position_embeddings": 1024}, 8192),
    "yarn short original": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 3.0,
                             "original_max_position_embeddings": 64, "beta_fast": 8, "beta_slow": 8}, 192),
}


def _hf_rotary(params: dict[str, Any], head_dim: int, max_pos: int) -> Any:
    """transformers' rotary embedding module for a tiny Llama with these rope parameters."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=2 * head_dim, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=max_pos, rope_parameters=copy.deepcopy(params))
    return LlamaRotaryEmbedding(config)


def _hf_tables(module: Any, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [len(positions), head_dim // 2] of one forward over `positions` (one sequence)."""
    import torch
    cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.as_tensor(positions)[None])
    half = cos.shape[-1] // 2
    cos, sin = cos[0].numpy(), sin[0].numpy()
    np.testing.assert_array_equal(cos[:, :half], cos[:, half:])  # rotate-half: the same twice
    return cos[:, :half], sin[:, :half]


def _rope(params: dict[str, Any], head_dim: int, max_pos: int) -> Rope:
    def fail(msg: str) -> Exception:
        return AssertionError(msg)
    return read_rope(params, max_pos=max_pos, head_dim=head_dim, fail=fail)


def _assert_freq_close(ours: np.ndarray, theirs: np.ndarray, *, ulps: int = 2) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
    # one ulp off in torch's pow is two of its reciprocal where a power of two lies between them
    off = np.abs(ours.astype(np.float64) - theirs) / np.spacing(theirs.astype(F32))
    assert off.max() <= ulps, off.max()


def _assert_tables_close(ours: np.ndarray, theirs: np.ndarray, positions: np.ndarray,
                         freq_ours: np.ndarray, freq_theirs: np.ndarray, scale: float) -> None:
    """Within 1e-6, plus, for a frequency one ulp from transformers', what that ulp explains."""
    pos = positions.astype(np.float64)[:, None]
    angle = np.abs(positions.astype(F32)[:, None] * freq_theirs)
    slack = np.where(freq_ours != freq_theirs,
                     pos * np.abs(freq_ours.astype(np.float64) - freq_theirs) + np.spacing(angle), 0.0)
    excess = np.abs(ours.astype(np.float64) - theirs) - (1e-6 + slack * scale)
    where = np.unravel_index(excess.argmax(), excess.shape)
    assert excess.max() <= 0, f"off by {excess.max() + 1e-6:.3g} at {where}"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_and_tables_match_transformers(case: str, head_dim: int) -> None:
    params, max_pos = CASES[case]
    rope = _rope(params, head_dim, max_pos)
    module = _hf_rotary(params, head_dim, max_pos)
    theirs = module.inv_freq.numpy()
    _assert_freq_close(inv_freq(rope, head_dim), theirs)
    assert attention_scaling(rope, head_dim) == pytest.approx(module.attention_scaling, rel=1e-12)

    # seq_lens: only dynamic reads them; 301 <= 64 is false, so "dynamic at base" is not at base
    # over 0..300, and is checked below instead
    if rope.type == "dynamic":
        return
    cos, sin = rope_tables(POSITIONS, rope, head_dim)
    assert cos.shape == sin.shape == (len(POSITIONS), 1, head_dim // 2) and cos.dtype == np.float32
    hf_cos, hf_sin = _hf_tables(module, POSITIONS)
    for ours, ref in ((cos[:, 0], hf_cos), (sin[:, 0], hf_sin)):
        _assert_tables_close(ours, ref, POSITIONS, inv_freq(rope, head_dim)[None], theirs[None],
                             module.attention_scaling)


def test_the_init_functions_agree_with_the_module() -> None:
    """The module's frequencies are ROPE_INIT_FUNCTIONS' (the reference the table test reads)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for case in ("linear 2", "llama3.1", "yarn deepseek mscale", "dynamic at base"):
        params, max_pos = CASES[case]
        module = _hf_rotary(params, 64, max_pos)
        freq, scaling = ROPE_INIT_FUNCTIONS[module.rope_type](module.config)
        np.testing.assert_array_equal(freq.numpy(), module.inv_freq.numpy())
        rope = _rope(params, 64, max_pos)
        assert attention_scaling(rope, 64) == pytest.approx(scaling, rel=1e-12)


DYNAMIC = [({"rope_type": "dynamic", "rope_theta": theta, "factor": factor}, 64)
           for theta, factor in ((10000.0, 2.0), (1e6, 4.0), (500000.0, 1.5))]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("params,max_pos", DYNAMIC)
def test_dynamic_prefill_matches_transformers_beyond_the_original_length(
        params: dict[str, Any], max_pos: int, head_dim: int) -> None:
    """A prompt of 200 tokens, 64 positions pretrained: one forward at seq_len 200; a prompt of
    50, within the original length: the base frequencies."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = _rope(params, head_dim, max_pos)
    assert rope.original_max_position_embeddings == max_pos
    for seq_len in (200, 50, 64, 65):
        module = _hf_rotary(params, head_dim, max_pos)
        positions = np.arange(seq_len)
        hf_cos, hf_sin = _hf_tables(module, positions)
        theirs = module.inv_freq.numpy()  # as the dynamic update left it
        if seq_len > max_pos:  # the update is ROPE_INIT_FUNCTIONS' at a tensor seq_len
            freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](module.config, seq_len=torch.tensor(seq_len))
            np.testing.assert_array_equal(freq.numpy(), theirs)
        ours = dynamic_inv_freq(rope, head_dim, np.array([seq_len]))
        _assert_freq_close(ours[0], theirs)
        for lens in (np.array([seq_len]), np.array([[seq_len]])):  # per row; batch of rows
            cos, sin = rope_tables(positions[None] if lens.ndim == 1 else positions[None, None],
                                   rope, head_dim, seq_lens=lens)
            cos, sin = cos.reshape(seq_len, head_dim // 2), sin.reshape(seq_len, head_dim // 2)
            for table, ref in ((cos, hf_cos), (sin, hf_sin)):
                _assert_tables_close(table, ref, positions, ours, theirs[None], 1.0)
        # in the graph, seq_lens traced: a few ulps from transformers' frequencies
        graph_freq = np.asarray(jax.jit(lambda s: dynamic_inv_freq(rope, head_dim, s))(jnp.asarray([seq_len])))
        _assert_freq_close(graph_freq[0], theirs, ulps=6)
        cos, sin = jax.jit(lambda p, s: rope_tables(p, rope, head_dim, seq_lens=s))(
            jnp.asarray(positions[None]), jnp.asarray([seq_len]))
        for table, ref in ((cos, hf_cos), (sin, hf_sin)):
            _assert_tables_close(np.asarray(table).reshape(seq_len, -1), ref, positions, graph_freq,
                                 theirs[None], 1.0)


@pytest.mark.parametrize("head_dim", (24, 128))
def test_dynamic_decode_matches_transformers_generation(head_dim: int) -> None:
    """A transformers generation decodes position p at seq_len p + 1: its frequencies grow every
    step past the original length; seq_lens = positions + 1 gives each step's row those."""
    params, max_pos = DYNAMIC[1]
    rope = _rope(params, head_dim, max_pos)
    module = _hf_rotary(params, head_dim, max_pos)
    _hf_tables(module, np.arange(40))  # the prompt
    steps = np.arange(40, 301)
    hf_cos, hf_sin, theirs = [], [], []
    for p in steps:  # one step a forward, as generate() runs them
        cos, sin = _hf_tables(module, np.array([p]))
        hf_cos.append(cos[0]), hf_sin.append(sin[0]), theirs.append(module.inv_freq.numpy().copy())
    ours = dynamic_inv_freq(rope, head_dim, steps + 1)
    _assert_freq_close(ours, np.stack(theirs))
    cos, sin = rope_tables(steps, rope, head_dim, seq_lens=steps + 1)
    assert cos.shape == (len(steps), 1, head_dim // 2)
    for table, ref in ((cos[:, 0], hf_cos), (sin[:, 0], hf_sin)):
        _assert_tables_close(table, np.stack(ref), steps, ours, np.stack(theirs), 1.0)
    # the same steps as one traced batch
    graph_freq = np.asarray(jax.jit(lambda s: dynamic_inv_freq(rope, head_dim, s))(jnp.asarray(steps + 1)))
    _assert_freq_close(graph_freq, np.stack(theirs), ulps=6)
    cos, sin = jax.jit(lambda p, s: rope_tables(p, rope, head_dim, seq_lens=s))(
        jnp.asarray(steps), jnp.asarray(steps + 1))
    for table, ref in ((cos[:, 0], hf_cos), (sin[:, 0], hf_sin)):
        _assert_tables_close(np.asarray(table), np.stack(ref), steps, graph_freq, np.stack(theirs), 1.0)


@pytest.mark.parametrize("head_dim", (24, 64))
def test_tables_in_the_graph_equal_the_host_tables(head_dim: int) -> None:
    """Traced positions and seq_lens under jit (no Python branch on their values) give the host's
    tables: prefill rows [n, P] with one seq_len a row, and decode [B] with one a position. For
    dynamic rope the graph has no float64 for its new base: its frequencies may be a few ulps
    from the host's, and its tables by what those ulps explain."""
    cases = [CASES["yarn deepseek mscale"], CASES["llama3.1"], CASES["linear 2"], DYNAMIC[0], DYNAMIC[1]]
    positions = np.stack([np.arange(300), np.arange(100, 400), np.arange(-1, 299).clip(0)]).astype(np.int32)
    prefill_lens = np.array([300, 400, 30], np.int32)
    decode = np.array([0, 63, 64, 65, 199, 4000, 70000], np.int32)
    for params, max_pos in cases:
        rope = _rope(params, head_dim, max_pos)
        fn = jax.jit(lambda p, s, rope=rope: rope_tables(p, rope, head_dim, seq_lens=s))
        freq_fn = jax.jit(lambda s, rope=rope: dynamic_inv_freq(rope, head_dim, s))
        for pos, lens in ((positions, prefill_lens), (decode, decode + 1)):
            host = rope_tables(pos, rope, head_dim, seq_lens=lens)
            graph = fn(jnp.asarray(pos), jnp.asarray(lens))
            if rope.type == "dynamic":
                host_freq = dynamic_inv_freq(rope, head_dim, lens)
                graph_freq = np.asarray(freq_fn(jnp.asarray(lens)))
                _assert_freq_close(graph_freq, host_freq, ulps=4)
                if lens.ndim == pos.ndim - 1:  # one row of frequencies for each row's positions
                    host_freq = np.repeat(host_freq, pos.shape[-1], 0)
                    graph_freq = np.repeat(graph_freq, pos.shape[-1], 0)
            else:
                host_freq = graph_freq = inv_freq(rope, head_dim)[None]
            for h, g in zip(host, graph):
                assert isinstance(g, jax.Array) and g.dtype == jnp.float32 and g.shape == h.shape
                flat = (-1, head_dim // 2)
                _assert_tables_close(np.asarray(g).reshape(flat), h.reshape(flat), pos.reshape(-1),
                                     graph_freq, host_freq, attention_scaling(rope, head_dim))


def test_dynamic_needs_seq_lens_of_a_matching_shape() -> None:
    rope = _rope(DYNAMIC[0][0], 64, 64)
    with pytest.raises(ValueError, match="needs each row's seq_len"):
        rope_tables(np.arange(4), rope, 64)
    with pytest.raises(ValueError, match=re.escape("seq_lens has shape (3,); positions (2, 4) need (2,)")):
        rope_tables(np.zeros((2, 4), np.int32), rope, 64, seq_lens=np.array([1, 2, 3]))
    # the other types read no seq_lens
    default = _rope(CASES["default"][0], 64, 64)
    np.testing.assert_array_equal(rope_tables(np.arange(4), default, 64, seq_lens=np.arange(4))[0],
                                  rope_tables(np.arange(4), default, 64)[0])


def test_inv_freq_is_memoised_and_read_only() -> None:
    rope = _rope(CASES["llama3.1"][0], 64, 131072)
    freq = inv_freq(rope, 64)
    assert inv_freq(Rope(**vars(rope)), 64) is freq
    with pytest.raises(ValueError):
        freq[0] = 0


def test_read_rope_normalises() -> None:
    def read(params: dict[str, Any], max_pos: int = 4096, **kw: Any) -> Rope:
        return read_rope(params, max_pos=max_pos, head_dim=64, fail=ValueError, **kw)

    assert ROPE_TYPES == ("default", "linear", "llama3", "dynamic", "yarn")
    # what a type does not read keeps its default: equal configs, equal Ropes
    assert read({}) == read({"rope_type": "default", "rope_theta": 10000.0}, 128) == Rope(theta=10000.0)
    assert read({}, default_theta=1e6) == Rope(theta=1e6)
    assert read({"type": "linear", "factor": 2}) == Rope(theta=10000.0, type="linear", factor=2.0)
    # dynamic scales from max_position_embeddings, whatever original_max_position_embeddings says
    assert read({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8},
                256).original_max_position_embeddings == 256
    yarn = read({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024,
                 "beta_fast": None, "truncate": None}, 8192)
    assert (yarn.factor, yarn.beta_fast, yarn.beta_slow, yarn.truncate) == (8.0, 32.0, 1.0, False)
    assert read({"rope_type": "yarn", "factor": 4}).original_max_position_embeddings == 4096
    assert read({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
                 "original_max_position_embeddings": None}).original_max_position_embeddings == 4096


REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "unknown type": ({"rope_type": "su"},
                     "rope type 'su' is not supported (default, linear, llama3, dynamic, yarn)"),
    "longrope": ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
                 "rope type 'longrope' is not supported (default, linear, llama3, dynamic, yarn)"),
    "4.x unknown type": ({"type": "ntk"}, "rope type 'ntk' is not supported"),
    "partial rotary": ({"rope_type": "default", "partial_rotary_factor": 0.5},
                       "partial_rotary_factor other than 1 is not supported"),
    "null theta": ({"rope_theta": None}, "rope_theta must be a positive number, got None"),
    "negative theta": ({"rope_theta": -1}, "rope_theta must be a positive number, got -1"),
    "linear without factor": ({"rope_type": "linear"}, "rope type 'linear' needs a factor"),
    "dynamic without factor": ({"rope_type": "dynamic"}, "rope type 'dynamic' needs a factor"),
    "yarn without factor": ({"rope_type": "yarn"}, "rope type 'yarn' needs a factor"),
    "llama3 without factor": ({"rope_type": "llama3", "low_freq_factor": 1, "high_freq_factor": 4},
                              "rope type 'llama3' needs a factor"),
    "negative factor": ({"rope_type": "yarn", "factor": -1}, "rope yarn factor must be a positive number, got -1"),
    "string factor": ({"rope_type": "dynamic", "factor": "2"},
                      "rope dynamic factor must be a positive number, got '2'"),
    "boolean factor": ({"rope_type": "linear", "factor": True},
                       "rope linear factor must be a positive number, got True"),
    "nan factor": ({"rope_type": "linear", "factor": float("nan")},
                   "rope linear factor must be a positive number, got nan"),
    "null factor": ({"rope_type": "linear", "factor": None},
                    "rope linear factor must be a positive number, got None"),
    "llama3 lacks low": ({"rope_type": "llama3", "factor": 8, "high_freq_factor": 4},
                         "llama3 rope scaling lacks 'low_freq_factor'"),
    "llama3 high at low": ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4},
                           "llama3 rope scaling needs high_freq_factor 4 above low_freq_factor 4"),
    "llama3 high below low": ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                               "high_freq_factor": 1.5},
                              "llama3 rope scaling needs high_freq_factor 1.5 above low_freq_factor 4"),
    "llama3 bad original": ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
                             "original_max_position_embeddings": 8192.0},
                            "original_max_position_embeddings must be a positive integer, got 8192.0"),
    "yarn beta_fast below beta_slow": ({"rope_type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 32},
                                       "yarn rope needs beta_fast 1 at or above beta_slow 32"),
    "yarn negative beta": ({"rope_type": "yarn", "factor": 4, "beta_slow": -1},
                           "yarn rope beta_slow must be a positive number, got -1"),
    "yarn string beta": ({"rope_type": "yarn", "factor": 4, "beta_fast": "32"},
                         "yarn rope beta_fast must be a positive number, got '32'"),
    "yarn bad original": ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0},
                          "original_max_position_embeddings must be a positive integer, got 0"),
    "yarn zero attention factor": ({"rope_type": "yarn", "factor": 4, "attention_factor": 0},
                                   "yarn rope attention_factor must be a positive number, got 0"),
    "yarn negative mscale": ({"rope_type": "yarn", "factor": 4, "mscale": -0.5, "mscale_all_dim": 1},
                             "yarn rope mscale must be a number at or above 0, got -0.5"),
    "yarn string truncate": ({"rope_type": "yarn", "factor": 4, "truncate": "yes"},
                             "yarn rope truncate must be true or false, got 'yes'"),
}


@pytest.mark.parametrize("defect", list(REFUSALS))
def test_read_rope_refuses(defect: str) -> None:
    params, message = REFUSALS[defect]

    class Refused(Exception):
        pass

    with pytest.raises(Refused, match="^" + re.escape(message)):
        read_rope(params, max_pos=4096, head_dim=64, fail=Refused)


def test_dynamic_refuses_a_head_dim_of_two() -> None:
    with pytest.raises(ValueError, match=re.escape("rope type 'dynamic' needs head_dim above 2, got 2")):
        read_rope({"rope_type": "dynamic", "factor": 2.0}, max_pos=64, head_dim=2, fail=ValueError)
