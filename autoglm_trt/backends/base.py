"""The one step contract every runtime backend runs (Polygraphy's runner, for a paged decoder).

A runner owns the KV block pools and runs one step of the engine's graph: given the step
inputs (``graph.paged_kv.step_inputs``) and the slots of the new tokens, it returns each
sequence's logits and has written the new K/V into its pools. ``close`` frees what it holds.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..graph.paged_kv import SlotMap


class StepRunner(Protocol):
    num_blocks: int
    block_size: int

    def step(self, feeds: dict[str, np.ndarray], slots: SlotMap) -> np.ndarray:
        """Run one step; return float32 logits ``[batch, vocab]``."""
        ...

    def close(self) -> None: ...
