"""Paged KV cache on the host: block allocator, block pools, step inputs, write-back.

Input: sequences (token ids, how many are already cached) and the graph's ``new_key/new_value``
outputs. Output: the graph's inputs for one step, and the pools updated in place.

Layout (one pool per layer for K and one for V)::

    pool[kv_heads, num_blocks, block_size, head_dim]
    sequence s, token at position p, KV head h  ->  pool[h, block_table[s][p // block_size], p % block_size]

    block_table of a 40-token sequence, block_size 16:  [7, 2, 9]
      block 7: positions  0..15 | block 2: 16..31 | block 9: 32..39 (8 slots still free)

The allocator hands out block ids from a free list (lowest id first, freed blocks return to
the end); it answers ``None`` when a request cannot be met and leaves the decision (wait,
preempt) to the caller.

KV heads come first so that the graph's ``Gather(pool, block_tables, axis=1)`` yields
``[kv_heads, batch, blocks, block_size, head_dim]``: each head's past keys and values are
already the contiguous ``[tokens, head_dim]`` matrices attention multiplies, with no
transpose or copy of the past in the step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing

POOL_LAYOUT = "[kv_heads, num_blocks, block_size, head_dim]"


def pool_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    return (kv_heads, num_blocks, block_size, head_dim)


class BlockAllocator:
    """Free list of block ids ``0..num_blocks-1``."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks from the head of the free list, or None if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        """Return blocks to the tail of the free list."""
        self._free.extend(blocks)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class SeqState:
    """One sequence's cache state: tokens already in the pool and its block table."""

    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)


class KVPools:
    """Per-layer K and V pools, written in place.

    All of them are views of one array ``data[2, num_layers, *pool_shape]`` (K then V), so a
    step's new K/V of every layer, stacked the same way, are scattered into the pools and
    blocks copied by one numpy operation each, not one per layer (``write_stacked``).

    The pools' memory is written once when they are made, so that the system commits all of it
    then. Left to a step's first write into a fresh block, each page fault zeroed its page inside
    the step: the first request on a fresh SmolLM2 engine (511 MiB of pools, huge pages) had one
    decode step of 734 ms. Making them now takes 1.2 s the first time in a process (the kernel
    assembles huge pages) and 0.06 s when it reuses them."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: np.typing.DTypeLike = np.float32):
        shape = pool_shape(num_blocks, block_size, kv_heads, head_dim)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.data = np.empty((2, num_layers, *shape), dtype=dtype)
        self.data.fill(0)  # every page touched now, not during a step (see above)
        self.keys = list(self.data[0])
        self.values = list(self.data[1])

    def feeds(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            out[f"past_key.{i}"] = k
            out[f"past_value.{i}"] = v
        return out

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src to block dst in every pool (destinations are distinct fresh blocks)."""
        if pairs:
            src, dst = (np.array(c, np.int64) for c in zip(*pairs))
            self.data[:, :, :, dst] = self.data[:, :, :, src]

    def write(self, outputs: dict[str, np.ndarray], slots: SlotMap) -> None:
        """Scatter every layer's new K/V into the pools at the slots of the step."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            new_k, new_v = outputs[f"new_key.{i}"], outputs[f"new_value.{i}"]
            k[:, slots.block, slots.offset] = new_k[slots.batch, slots.token].swapaxes(0, 1)
            v[:, slots.block, slots.offset] = new_v[slots.batch, slots.token].swapaxes(0, 1)

    def write_stacked(self, new: np.ndarray, slots: SlotMap) -> None:
        """``write`` for new K/V stacked as ``[2, num_layers, batch, tokens, kv_heads, head_dim]``
        (K then V, like ``data``): one scatter for all layers."""
        self.data[:, :, :, slots.block, slots.offset] = new[:, :, slots.batch, slots.token].swapaxes(2, 3)


@dataclass(frozen=True)
class SlotMap:
    """Where each valid new token goes: ``(batch, token) -> (block, offset)``, flat arrays."""

    batch: np.ndarray
    token: np.ndarray
    block: np.ndarray
    offset: np.ndarray


def step_inputs(new_tokens: list[list[int]], states: list[SeqState], block_size: int,
                all_logits: bool = False) -> tuple[dict[str, np.ndarray], SlotMap]:
    """Graph inputs (without the pools) for one step, and the slots of the new tokens.

    Every sequence must have at least one new token and a block table that already covers
    ``num_computed_tokens + len(new_tokens)`` positions. Logits are asked for the last new
    token of each sequence, or with ``all_logits`` for every new token (padding repeats the
    last one).
    """
    batch = len(new_tokens)
    assert batch == len(states) and batch > 0
    if not all_logits and all(len(t) == 1 for t in new_tokens):
        return _decode_inputs(new_tokens, states, block_size)
    t_max = max(len(t) for t in new_tokens)
    max_ctx = max(s.num_computed_tokens for s in states)
    max_blocks = max(1, blocks_needed(max_ctx, block_size))
    input_ids = np.zeros((batch, t_max), np.int64)
    position_ids = np.zeros((batch, t_max), np.int64)
    block_tables = np.zeros((batch, max_blocks), np.int64)
    context_lens = np.zeros(batch, np.int64)
    query_lens = np.zeros(batch, np.int64)
    logits_indices = np.zeros((batch, t_max if all_logits else 1), np.int64)
    sb, st, sk, so = [], [], [], []
    for b, (toks, state) in enumerate(zip(new_tokens, states)):
        n, ctx = len(toks), state.num_computed_tokens
        assert n >= 1, "every sequence in a step needs at least one new token"
        table = state.block_table
        assert len(table) * block_size >= ctx + n, "block table does not cover the new tokens"
        input_ids[b, :n] = toks
        positions = np.arange(ctx, ctx + n)
        position_ids[b, :n] = positions
        used = blocks_needed(ctx, block_size)
        block_tables[b, :used] = table[:used]
        context_lens[b], query_lens[b] = ctx, n
        logits_indices[b] = np.minimum(np.arange(logits_indices.shape[1]), n - 1) if all_logits else n - 1
        sb.append(np.full(n, b))
        st.append(np.arange(n))
        sk.append(np.asarray(table, np.int64)[positions // block_size])
        so.append(positions % block_size)
    feeds = {"input_ids": input_ids, "position_ids": position_ids, "context_lens": context_lens,
             "query_lens": query_lens, "block_tables": block_tables, "logits_indices": logits_indices}
    slots = SlotMap(*(np.concatenate(a).astype(np.int64) for a in (sb, st, sk, so)))
    return feeds, slots


def _decode_inputs(new_tokens: list[list[int]], states: list[SeqState],
                   block_size: int) -> tuple[dict[str, np.ndarray], SlotMap]:
    """``step_inputs`` of a decode step (one new token per sequence, the last token's logits):
    the same arrays, built from lists in a few numpy calls rather than a dozen per sequence
    (at batch 1 the general form took about 0.09 ms of a 6 ms step)."""
    batch = len(new_tokens)
    ctx = [s.num_computed_tokens for s in states]
    tables = np.zeros((batch, max(1, blocks_needed(max(ctx), block_size))), np.int64)
    slot_blocks = []
    for b, (state, c) in enumerate(zip(states, ctx)):
        table = state.block_table
        assert len(table) * block_size >= c + 1, "block table does not cover the new tokens"
        used = blocks_needed(c, block_size)
        if used:
            tables[b, :used] = table[:used]
        slot_blocks.append(table[c // block_size])
    positions = np.array(ctx, np.int64)
    feeds = {"input_ids": np.array(new_tokens, np.int64), "position_ids": positions[:, None].copy(),
             "context_lens": positions, "query_lens": np.ones(batch, np.int64), "block_tables": tables,
             "logits_indices": np.zeros((batch, 1), np.int64)}
    slots = SlotMap(np.arange(batch, dtype=np.int64), np.zeros(batch, np.int64), np.array(slot_blocks, np.int64),
                    positions % block_size)
    return feeds, slots
