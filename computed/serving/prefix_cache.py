"""The prefix cache's index: which block of the store holds which prefix block, LRU.

A block is named by its chain hash (shared/prefix.py: the adapter's content root and every
token up to the block's end), so a hit is exact: same content, same tokens before it. The
store (computed/model/kv_blocks.py) has `capacity` blocks, all the KV budget leaves after the
running rows (--kv-cache-mb); when it is full the least recently used block goes.

Order of eviction: a lookup or a save touches a chain's blocks from its end back to its root,
so a chain's root is always more recent than its later blocks and goes last. (Blocks are
useful only behind their parent: a lookup stops at the first block it misses.)

This is host bookkeeping only; the engine (computed/serving/engine.py) does the copies.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from shared.prefix import BLOCK_TOKENS, SUMMARY_LIMIT, block_hashes, summary_depths


@dataclass
class Hit:
    """A prompt's lookup: its chain hashes, and the store blocks of its longest cached prefix."""

    chain: list[str]
    ids: list[int]

    @property
    def tokens(self) -> int:
        return len(self.ids) * BLOCK_TOKENS


class PrefixCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix cache needs at least one block; got {capacity}")
        self.capacity = capacity
        self.blocks: OrderedDict[str, tuple[int, int]] = OrderedDict()  # hash -> (block id, depth); LRU first
        self.free = list(range(capacity - 1, -1, -1))
        self.lookups = self.hit_tokens = self.prompt_tokens = 0

    def lookup(self, root: str, tokens: Sequence[int]) -> Hit:
        """The longest cached prefix of `tokens` under `root`, leaving at least its last token to
        compute (its logits start the output)."""
        chain = block_hashes(root, tokens)
        ids: list[int] = []
        for h in chain[:(len(tokens) - 1) // BLOCK_TOKENS]:
            entry = self.blocks.get(h)
            if entry is None:
                break
            ids.append(entry[0])
        self._touch(chain[:len(ids)])
        self.lookups += 1
        self.prompt_tokens += len(tokens)
        self.hit_tokens += len(ids) * BLOCK_TOKENS
        return Hit(chain, ids)

    def claim(self, hit: Hit) -> tuple[list[int], list[int]]:
        """Store blocks for the blocks of `hit`'s prompt not cached yet (the prompt now fully in
        its row): (row blocks, store blocks), pairwise, evicting the least recently used. Blocks
        of this same prompt are never evicted for it (a store smaller than the prompt keeps its
        first blocks)."""
        src: list[int] = []
        dst: list[int] = []
        mine = set(hit.chain)
        for j, h in enumerate(hit.chain):
            if h in self.blocks:
                continue
            if not self.free:
                oldest = next(iter(self.blocks))
                if oldest in mine:
                    break
                self.free.append(self.blocks.pop(oldest)[0])
            block = self.free.pop()
            self.blocks[h] = (block, j + 1)
            src.append(j)
            dst.append(block)
        self._touch([h for h in hit.chain if h in self.blocks])
        return src, dst

    def _touch(self, chain: Sequence[str]) -> None:
        for h in reversed(chain):
            self.blocks.move_to_end(h)

    def summary(self, limit: int = SUMMARY_LIMIT) -> list[str]:
        """The hashes held at the depths routers match (shared/prefix.py), most recent first."""
        depths = set(summary_depths(1 << 30))
        out = []
        for h, (_, depth) in reversed(self.blocks.items()):
            if depth in depths:
                out.append(h)
                if len(out) >= limit:
                    break
        return out

    def status(self) -> dict[str, object]:
        """`status`'s `prefix_cache` field (docs/protocol.md)."""
        return {"block_tokens": BLOCK_TOKENS, "capacity_blocks": self.capacity, "used_blocks": len(self.blocks),
                "lookups": self.lookups, "hit_tokens": self.hit_tokens, "prompt_tokens": self.prompt_tokens,
                "summary": self.summary()}
