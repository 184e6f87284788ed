"""The paged KV layout of the engine contract, on the host.

One pool per layer for K and one for V::

    pool[kv_heads, num_blocks, block_size, head_dim]
    sequence s, token at position p, KV head h  ->  pool[h, block_table[s][p // block_size], p % block_size]

    block_table of a 40-token sequence, block_size 16:  [7, 2, 9]
      block 7: positions  0..15 | block 2: 16..31 | block 9: 32..39 (8 slots still free)

KV heads come first so that the graph's ``Gather(pool, block_tables, axis=1)`` yields
``[kv_heads, batch, blocks, block_size, head_dim]``: each head's past keys and values are
already the contiguous ``[tokens, head_dim]`` matrices attention multiplies, with no
transpose or copy of the past in the step.
"""

from __future__ import annotations

import numpy as np

POOL_LAYOUT = "[kv_heads, num_blocks, block_size, head_dim]"


def pool_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    return (kv_heads, num_blocks, block_size, head_dim)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_slots(pairs: list[tuple[int, int]], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The slots (``block * block_size + offset``) of block copies ``(src, dst)``: every slot of
    each source block, and the slot it goes to, in pair order. A pool viewed as
    ``[kv_heads, num_blocks * block_size, head_dim]`` copies block src to dst as
    ``pool[:, to] = pool[:, from]``."""
    if not pairs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    src, dst = (np.array(c, np.int64) for c in zip(*pairs))
    offsets = np.arange(block_size, dtype=np.int64)
    return (src[:, None] * block_size + offsets).reshape(-1), (dst[:, None] * block_size + offsets).reshape(-1)
