"""The host tier: parsed adapter weights ready for a slot write, LRU within a byte bound.

Between the device slots (computed/residency.py) and the verified on-disk blob cache
(computed/weights.py): an entry is one registered adapter version's parsed A and B arrays
(computed/pool.py's SlotWeights, unpadded: the slot write pads them to max_rank), so filling
a slot from it costs the slot write alone. The bookkeeping is shared/lru.py's `ByteLRU` (the
rules are there), sized by `weights_bytes`; the fill worker (computed/fills.py) holds its
lock around every call.
"""
from __future__ import annotations

import numpy as np

from computed.pool import SlotWeights
from shared.lru import ByteLRU

HostTier = ByteLRU


def weights_bytes(w: SlotWeights) -> int:
    """The host bytes of an adapter's parsed arrays."""
    return sum(int(np.asarray(a).nbytes) + int(np.asarray(b).nbytes) for a, b in w.pairs.values())
