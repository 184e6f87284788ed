"""TensorRT runner: ``execute_async_v3`` over device buffers (cuda.bindings), the one step contract.

Device memory, all allocated once at load for the engine's limits (``buffer_plan``): one K
and one V pool per layer ``[kv_heads, num_blocks, block_size, head_dim]``; one buffer per step
input, each with a pinned host twin the step's inputs are staged through (true asynchronous
copies); the new K/V of up to ``max_batch x max_input_len`` tokens; the logits of one token per
sequence ``[max_batch, vocab]`` (the runtime asks for the last token's logits only). After
the step the new K/V are scattered into every pool by one launch of a small CUDA kernel compiled
with NVRTC (copy-on-write block copies are one launch of the same kernel), and the logits come
back through a pinned buffer.

Every TensorRT call that reports failure by returning False is checked (``require``), so a
shape outside the engine's profiles is named as such, not as "execute_async_v3 failed". The
optimization profile (0: prefill, 1: decode) is switched only when the step's kind changes.
The CUDA parts (``cuda``) are exercised on a GPU by ``tests/gpu/test_cuda_runtime.py``; this module needs
TensorRT as well and is not run in CI; its buffer plan and profile choice are tested on CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...artifacts import EngineError
from ...kvcache.host_pools import SlotMap
from ...kvcache.layout import blocks_needed, pool_shape
from ...model.spec import ModelSpec

PREFILL_PROFILE, DECODE_PROFILE = 0, 1
STEP_INPUTS = ("input_ids", "position_ids", "context_lens", "query_lens", "block_tables", "logits_indices")
IMAGE_INPUTS = ("image_embeds", "image_index")  # a vision family's


def buffer_plan(spec: ModelSpec, max_batch: int, max_tokens: int, max_seq_len: int,
                block_size: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Largest shape and dtype of every per-step buffer: the step inputs, the new K/V rows, the logits."""
    i64 = np.dtype(np.int64)
    plan: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        "input_ids": ((max_batch, max_tokens), i64),
        "position_ids": ((3, max_batch, max_tokens) if spec.mrope else (max_batch, max_tokens), i64),
        "context_lens": ((max_batch,), i64),
        "query_lens": ((max_batch,), i64),
        "block_tables": ((max_batch, blocks_needed(max_seq_len, block_size)), i64),
        "logits_indices": ((max_batch, 1), i64),
        "logits": ((max_batch, spec.vocab_size), np.dtype(np.float32)),
    }
    if spec.vision:
        plan["image_embeds"] = ((1 + max_batch * max_tokens, spec.hidden_size), np.dtype(np.float32))
        plan["image_index"] = ((max_batch, max_tokens), i64)
    return plan


def profile_for(tokens: int) -> int:
    """The optimization profile of a step with ``tokens`` new tokens per sequence."""
    return DECODE_PROFILE if tokens == 1 else PREFILL_PROFILE


def require(ok: object, what: str) -> None:
    """Raise ``EngineError`` when a TensorRT call returned False."""
    if ok is False or ok is None:
        raise EngineError(f"TensorRT refused {what}")


def check_row_alignment(head_dim: int, kv_dtype: np.dtype) -> None:
    """The scatter kernel moves 32-bit words: a head's row must be a whole number of them."""
    if head_dim * np.dtype(kv_dtype).itemsize % 4:
        raise EngineError(f"head_dim {head_dim} x {np.dtype(kv_dtype).itemsize} bytes is not a multiple of 4 bytes, "
                          "which the KV scatter kernel needs")


class TrtRunner:
    def __init__(self, plan_path: Path, spec: ModelSpec, num_blocks: int, block_size: int, kv_dtype: str,
                 max_batch: int, max_tokens: int, max_seq_len: int):
        from . import cuda as cu
        from .probe import require_tensorrt

        require_tensorrt()
        import tensorrt as trt

        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.kv_dtype = np.dtype(kv_dtype)
        check_row_alignment(spec.head_dim, self.kv_dtype)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise EngineError(f"TensorRT could not deserialize {plan_path}; rebuild the engine with this TensorRT")
        self.context = self.engine.create_execution_context()
        self.stream = cu.Stream()
        self._profile: int | None = None
        pools = pool_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.pools = {f"past_{kind}.{i}": cu.DeviceArray.zeros(pools, self.kv_dtype)
                      for i in range(spec.num_layers) for kind in ("key", "value")}
        row = spec.num_kv_heads * spec.head_dim
        self.new_kv = {f"new_{kind}.{i}": cu.DeviceArray.empty((max_batch * max_tokens, row), self.kv_dtype)
                       for i in range(spec.num_layers) for kind in ("key", "value")}
        plan = buffer_plan(spec, max_batch, max_tokens, max_seq_len, block_size)
        self.device = {name: cu.DeviceArray.empty(shape, dtype) for name, (shape, dtype) in plan.items()}
        self.host = {name: cu.PinnedArray(shape, dtype) for name, (shape, dtype) in plan.items()}
        self.kernels = cu.PoolKernels()
        self.kernels.bind([(self.new_kv[f"new_{kind}.{i}"], self.pools[f"past_{kind}.{i}"])
                           for i in range(spec.num_layers) for kind in ("key", "value")])
        self.max_batch, self.max_tokens = max_batch, max_tokens
        for name, pool in self.pools.items():  # fixed for the engine's life
            require(self.context.set_tensor_address(name, pool.ptr), f"the address of {name}")
        for name, buf in self.new_kv.items():
            require(self.context.set_tensor_address(name, buf.ptr), f"the address of {name}")
        require(self.context.set_tensor_address("logits", self.device["logits"].ptr), "the address of logits")

    def _stage(self, name: str, arr: np.ndarray) -> None:
        """Copy a step input into its pinned buffer, then to the device, asynchronously."""
        host = self.host[name].array
        if arr.size > host.size:
            raise EngineError(f"step input {name} of shape {arr.shape} exceeds the engine's limits {host.shape}")
        flat = host.reshape(-1)[: arr.size]
        flat[:] = arr.reshape(-1)
        self.device[name].copy_from_host(flat, self.stream)

    def step(self, feeds: dict[str, np.ndarray], slots: SlotMap) -> np.ndarray:
        batch, tokens = feeds["input_ids"].shape
        if feeds["logits_indices"].shape[1] != 1:
            raise EngineError("the TensorRT runner computes one logit row per sequence (logits_indices [batch, 1])")
        profile = profile_for(tokens)
        if profile != self._profile:
            require(self.context.set_optimization_profile_async(profile, self.stream.handle),
                    f"optimization profile {profile}")
            self._profile = profile
        for name in STEP_INPUTS + (IMAGE_INPUTS if self.spec.vision else ()):
            arr = feeds[name]
            self._stage(name, arr)
            require(self.context.set_input_shape(name, arr.shape),
                    f"input {name} of shape {tuple(arr.shape)}: outside optimization profile {profile} of this engine")
            require(self.context.set_tensor_address(name, self.device[name].ptr), f"the address of {name}")
        for name, pool in self.pools.items():
            require(self.context.set_input_shape(name, pool.shape), f"the pool shape of {name}")
        if not self.context.execute_async_v3(self.stream.handle):
            raise EngineError("TensorRT execute_async_v3 failed; see TensorRT's log above")
        src = (slots.batch * tokens + slots.token).astype(np.int64)
        dst = (slots.block * self.block_size + slots.offset).astype(np.int64)
        self.kernels.set_rows(src, dst, self.stream)
        self.kernels(self.stream)
        self.device["logits"].copy_to_host(self.host["logits"], batch, self.stream)
        self.stream.synchronize()
        return self.host["logits"].array[:batch].copy()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of shared blocks: block src to block dst in every pool, one launch for all."""
        self.kernels.copy_blocks(pairs, self.block_size, self.stream)
        self.stream.synchronize()

    def close(self) -> None:
        for arr in [*self.pools.values(), *self.new_kv.values(), *self.device.values()]:
            arr.free()
        for pinned in self.host.values():
            pinned.free()
        self.kernels.free()
