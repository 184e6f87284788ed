"""Host KV pools (numpy), written in place, and where a step's new K/V go in them (``SlotMap``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing

from ..graph.names import scale_of
from .layout import pool_shape


class KVPools:
    """Per-layer K and V pools, written in place.

    All of them are views of one array ``data[2, num_layers, *pool_shape]`` (K then V), so a
    step's new K/V of every layer, stacked the same way, are scattered into the pools and
    blocks copied by one numpy operation each, not one per layer (``write_stacked``).

    The pools' memory is written once when they are made, so that the system commits all of it
    then. Left to a step's first write into a fresh block, each page fault zeroed its page inside
    the step, and the first request on a fresh engine had a decode step many times longer than
    the others. The cost now comes once, when the pools are made, and is largest the first time
    in a process (the kernel assembles huge pages)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: np.typing.DTypeLike = np.float32, token_scales: bool = False):
        """``token_scales``: an INT8 KV cache with a float32 scale per token and KV head
        (``graph/kv_int8.py``), kept in ``scales[2, num_layers, kv_heads, num_blocks, block_size]``."""
        shape = pool_shape(num_blocks, block_size, kv_heads, head_dim)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.data = np.empty((2, num_layers, *shape), dtype=dtype)
        self.data.fill(0)  # every page touched now, not during a step (see above)
        self.keys = list(self.data[0])
        self.values = list(self.data[1])
        self.scales = np.empty((2, num_layers, *shape[:3]), np.float32) if token_scales else None
        if self.scales is not None:
            self.scales.fill(0)  # touched now too

    def feeds(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            out[f"past_key.{i}"] = k
            out[f"past_value.{i}"] = v
            if self.scales is not None:
                out[scale_of(f"past_key.{i}")] = self.scales[0, i]
                out[scale_of(f"past_value.{i}")] = self.scales[1, i]
        return out

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src to block dst in every pool (destinations are distinct fresh blocks)."""
        if pairs:
            src, dst = (np.array(c, np.int64) for c in zip(*pairs))
            self.data[:, :, :, dst] = self.data[:, :, :, src]
            if self.scales is not None:
                self.scales[:, :, :, dst] = self.scales[:, :, :, src]

    def write(self, outputs: dict[str, np.ndarray], slots: SlotMap) -> None:
        """Scatter every layer's new K/V (and their scales) into the pools at the slots of the step."""
        for i in range(len(self.keys)):
            for kind, name in enumerate((f"new_key.{i}", f"new_value.{i}")):
                pool = self.data[kind, i]
                pool[:, slots.block, slots.offset] = outputs[name][slots.batch, slots.token].swapaxes(0, 1)
                if self.scales is not None:
                    new = outputs[scale_of(name)][slots.batch, slots.token]
                    self.scales[kind, i][:, slots.block, slots.offset] = new.swapaxes(0, 1)

    def write_stacked(self, new: np.ndarray, slots: SlotMap, new_scales: np.ndarray | None = None) -> None:
        """``write`` for new K/V stacked as ``[2, num_layers, batch, tokens, kv_heads, head_dim]``
        (K then V, like ``data``; their scales ``[2, num_layers, batch, tokens, kv_heads]``): one
        scatter for all layers."""
        self.data[:, :, :, slots.block, slots.offset] = new[:, :, slots.batch, slots.token].swapaxes(2, 3)
        if self.scales is not None:
            assert new_scales is not None, "an INT8 KV cache with per-token scales stores them with the K/V"
            self.scales[:, :, :, slots.block, slots.offset] = new_scales[:, :, slots.batch, slots.token].swapaxes(2, 3)


@dataclass(frozen=True)
class SlotMap:
    """Where each valid new token goes: ``(batch, token) -> (block, offset)``, flat arrays."""

    batch: np.ndarray
    token: np.ndarray
    block: np.ndarray
    offset: np.ndarray
