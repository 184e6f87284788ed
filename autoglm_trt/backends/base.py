"""The one step contract every runtime backend runs (Polygraphy's runner, for a paged decoder).

A runner owns the KV block pools and runs one step of the engine's graph: given the step
inputs (``kvcache.step_inputs``) and the slots of the new tokens, it returns each
sequence's logits (which its next step may overwrite) and has written the new K/V into its
pools. ``copy_blocks`` copies whole blocks of every pool (copy-on-write of a block that forked
sequences share; the scheduler asks for it before the step that writes there). ``close`` frees
what it holds.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..kvcache.host_pools import SlotMap


class StepRunner(Protocol):
    num_blocks: int
    block_size: int

    def step(self, feeds: dict[str, np.ndarray], slots: SlotMap) -> np.ndarray:
        """Run one step; return float32 logits ``[batch, vocab]``: possibly the runner's own output
        buffer, valid until its next step (a caller that keeps logits longer copies them)."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """For each (source, destination), copy block source to block destination in every K and V pool."""
        ...

    def close(self) -> None: ...
