"""TensorRT backend of the runtime: ``execute_async_v3`` over device buffers (cuda.bindings).

Device memory: one K and one V pool per layer ``[kv_heads, num_blocks, block_size, head_dim]``,
per-step input buffers sized for the engine's limits, output buffers for the logits and the
new K/V. Small inputs go host -> device through pinned buffers; after the step the new K/V
are scattered into the pools by a small CUDA kernel compiled with NVRTC, and the logits come
back through a pinned buffer. The CUDA parts (``cuda_utils``) are exercised on a GPU by
``scripts/gpu_check.py``; this module needs TensorRT as well and is not run in CI.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...graph.paged_kv import SlotMap, pool_shape
from ...model.spec import ModelSpec
from . import cuda as cu


class TrtRunner:
    def __init__(self, plan_path: Path, spec: ModelSpec, num_blocks: int, block_size: int, kv_dtype: str,
                 max_batch: int, max_tokens: int):
        from .probe import require_tensorrt

        require_tensorrt()
        import tensorrt as trt

        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.kv_dtype = np.dtype(kv_dtype)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(plan_path.read_bytes())
        self.context = self.engine.create_execution_context()
        self.stream = cu.Stream()
        pools = pool_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.pools = {f"past_{kind}.{i}": cu.DeviceArray.zeros(pools, self.kv_dtype)
                      for i in range(spec.num_layers) for kind in ("key", "value")}
        row = spec.num_kv_heads * spec.head_dim
        self.new_kv = {f"new_{kind}.{i}": cu.DeviceArray.empty((max_batch * max_tokens, row), self.kv_dtype)
                       for i in range(spec.num_layers) for kind in ("key", "value")}
        self.logits = cu.DeviceArray.empty((max_batch * max_tokens, spec.vocab_size), np.dtype(np.float32))
        self.host_logits = cu.PinnedArray((max_batch * max_tokens, spec.vocab_size), np.dtype(np.float32))
        self.inputs: dict[str, cu.DeviceArray] = {}
        self.scatter = cu.ScatterKernel()
        self.max_batch, self.max_tokens = max_batch, max_tokens

    def _input(self, name: str, arr: np.ndarray) -> int:
        buf = self.inputs.get(name)
        if buf is None or buf.nbytes < arr.nbytes:
            buf = cu.DeviceArray.empty((max(arr.size, 1) * 2,), arr.dtype)
            self.inputs[name] = buf
        buf.copy_from_host(np.ascontiguousarray(arr), self.stream)
        return buf.ptr

    def step(self, feeds: dict[str, np.ndarray], slots: SlotMap) -> np.ndarray:
        batch, tokens = feeds["input_ids"].shape
        profile = 1 if tokens == 1 else 0  # decode profile, prefill profile
        self.context.set_optimization_profile_async(profile, self.stream.handle)
        for name, arr in feeds.items():
            self.context.set_input_shape(name, arr.shape)
            self.context.set_tensor_address(name, self._input(name, arr))
        for name, pool in self.pools.items():
            self.context.set_input_shape(name, pool.shape)
            self.context.set_tensor_address(name, pool.ptr)
        for name, buf in self.new_kv.items():
            self.context.set_tensor_address(name, buf.ptr)
        self.context.set_tensor_address("logits", self.logits.ptr)
        if not self.context.execute_async_v3(self.stream.handle):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        src = (slots.batch * tokens + slots.token).astype(np.int64)
        dst = (slots.block * self.block_size + slots.offset).astype(np.int64)
        self.scatter.set_rows(src, dst, self.stream)
        for i in range(self.spec.num_layers):
            for kind in ("key", "value"):
                self.scatter(self.new_kv[f"new_{kind}.{i}"], self.pools[f"past_{kind}.{i}"], self.stream)
        n = batch * feeds["logits_indices"].shape[1]
        self.logits.copy_to_host(self.host_logits, n, self.stream)
        self.stream.synchronize()
        return self.host_logits.array[:n].reshape(batch, -1, self.spec.vocab_size)[:, 0].copy()

    def close(self) -> None:
        for arr in [*self.pools.values(), *self.new_kv.values(), *self.inputs.values(), self.logits]:
            arr.free()
        self.host_logits.free()
        self.scatter.free()
