"""The prefix cache's index (pure bookkeeping): exact keys by content root and token chain, LRU
that evicts a chain's last blocks before its root, never more blocks than its capacity."""
from __future__ import annotations

from computed.serving.prefix_cache import PrefixCache
from shared.prefix import BASE_ROOT, block_hashes, content_root, matched_tokens

A = content_root("a" * 64, 2.0)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 7 * i) % 500 for i in range(n)]


def fill(cache: PrefixCache, root: str, tokens: list[int]) -> list[int]:
    """Look `tokens` up and save them as a prefill would: the store blocks it claimed."""
    hit = cache.lookup(root, tokens)
    return cache.claim(hit)[1]


def test_a_hit_needs_the_same_content_and_the_same_tokens_before() -> None:
    cache = PrefixCache(16)
    p = prompt(1, 50)  # 3 whole blocks
    assert fill(cache, A, p) == [0, 1, 2]
    assert cache.lookup(A, p + [9]).ids == [0, 1, 2]
    assert cache.lookup(A, p).ids == [0, 1, 2]  # 50 tokens: the last is computed anyway
    assert cache.lookup(A, p[:48]).ids == [0, 1]  # a whole-block prompt keeps its last block to compute
    assert cache.lookup(content_root("a" * 64, 4.0), p).ids == []  # same weights, other alpha
    assert cache.lookup(content_root("b" * 64, 2.0), p).ids == []
    assert cache.lookup(BASE_ROOT, p).ids == []
    assert cache.lookup(A, [p[0] + 1] + p[1:]).ids == []  # a chain: block 0 differs, nothing hits
    assert cache.hit_tokens == 16 * (3 + 3 + 2)


def test_eviction_takes_a_chains_last_blocks_first_and_keeps_to_capacity() -> None:
    cache = PrefixCache(4)
    a, b = prompt(1, 48), prompt(2, 48)
    fill(cache, A, a)  # 3 blocks
    fill(cache, A, b)  # 3 more: two of a's go, its last ones
    assert len(cache.blocks) == 4
    assert len(cache.lookup(A, a + [1]).ids) == 1
    assert len(cache.lookup(A, b + [1]).ids) == 3
    long = prompt(3, 16 * 9)  # longer than the store: its first blocks are kept, not cycled
    fill(cache, A, long)
    assert len(cache.lookup(A, long + [1]).ids) == 4 and len(cache.blocks) == 4


def test_the_summary_reports_power_of_two_depths_as_routers_match_them() -> None:
    cache = PrefixCache(32)
    p = prompt(4, 16 * 9)
    fill(cache, A, p)
    chain = block_hashes(A, p)
    summary = cache.summary()
    assert set(summary) == {chain[0], chain[1], chain[3], chain[7]}
    assert matched_tokens(A, p, set(summary)) == 16 * 8
    assert matched_tokens(A, p[:40], set(summary)) == 32
    assert matched_tokens(BASE_ROOT, p, set(summary)) == 0
