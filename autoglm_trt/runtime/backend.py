"""The step protocol shared by the runtime's backends, and the ONNX Runtime backend.

A backend owns the KV block pools and runs one step of the graph: given the step inputs
(``paged_kv.step_inputs``) and the slots of the new tokens, it returns each sequence's
logits and has written the new K/V into its pools.

ONNX Runtime: the pools are numpy arrays wrapped once as ``OrtValue`` (no copy on the CPU) and
bound with I/O binding, so a step passes only the small per-step inputs; the new K/V are
scattered into the pools in place with numpy fancy indexing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from ..arch import ModelSpec
from ..paged_kv import KVPools, SlotMap


class StepBackend(Protocol):
    num_blocks: int
    block_size: int

    def step(self, feeds: dict[str, np.ndarray], slots: SlotMap) -> np.ndarray:
        """Run one step; return float32 logits ``[batch, vocab]``."""
        ...

    def close(self) -> None: ...


class OrtBackend:
    def __init__(self, model_path: Path, spec: ModelSpec, num_blocks: int, block_size: int, kv_dtype: str,
                 threads: int = 0):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pools = KVPools(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, kv_dtype)
        self._pool_values = {name: ort.OrtValue.ortvalue_from_numpy(arr) for name, arr in self.pools.feeds().items()}
        self._outputs = [o.name for o in self.session.get_outputs()]

    def step(self, feeds: dict[str, np.ndarray], slots: SlotMap) -> np.ndarray:
        binding = self.session.io_binding()
        for name, value in self._pool_values.items():
            binding.bind_ortvalue_input(name, value)
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        for name in self._outputs:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        out = dict(zip(self._outputs, binding.copy_outputs_to_cpu()))
        self.pools.write(out, slots)
        return out["logits"][:, 0]

    def close(self) -> None:
        self._pool_values.clear()
