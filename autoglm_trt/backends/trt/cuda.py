"""The CUDA side of the TensorRT runtime, on ``cuda.bindings`` (cuda-python) alone.

Device arrays (``cudaMalloc``), pinned host arrays (``cudaMallocHost``), a stream, and a kernel
that moves rows into the KV pools (the step's new K/V, block copies): compiled at run time with
NVRTC to PTX for this GPU, loaded with the driver API, launched on the stream. Every call's
status is checked. Used by ``runner`` and tested on a GPU by ``tests/gpu/test_cuda_runtime.py``
and ``scripts/gpu_check.py`` (no TensorRT needed for that).

The scatter kernel copies one token's K (or V) into its pool slot, head by head:
``pool[h, dst_slot[i]] = src[src_row[i], h]`` for every token i and KV head h, where ``src``
is the step's ``[tokens, kv_heads, head_dim]`` output and ``pool`` is
``[kv_heads, num_blocks * block_size, head_dim]`` (``kvcache.layout.POOL_LAYOUT``); a head's
``head_dim`` elements move as 32-bit words (float32, or pairs of float16). The same kernel makes
copy-on-write copies (``within``): ``pool[h, to_slot[i]] = pool[h, from_slot[i]]`` (the slots of
whole blocks; destinations are fresh blocks, never a source). One launch of either serves every
(output, pool) pair of the engine (``blockIdx.y`` picks the pair from a table of device pointers
uploaded once): a launch from Python costs tens of microseconds of host time, and a step has
two pools a layer.
"""

from __future__ import annotations

import numpy as np

from ...errors import MissingDependencyError
from ...kvcache.layout import block_slots

SCATTER_SOURCE = r"""
extern "C" __global__ void move_rows(const unsigned long long* __restrict__ srcs, const unsigned long long* dsts,
                                     const long long* __restrict__ from, const long long* __restrict__ to,
                                     int n_rows, int kv_heads, int head_words, long long pool_slots, int within) {
    unsigned int* dst = (unsigned int*)dsts[blockIdx.y];
    const unsigned int* src = within ? dst : (const unsigned int*)srcs[blockIdx.y];
    long long row_words = (long long)kv_heads * head_words;
    long long total = (long long)n_rows * row_words;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / row_words;
        long long rest = i - r * row_words;
        long long h = rest / head_words;
        long long w = rest - h * head_words;
        long long at = within ? (h * pool_slots + from[r]) * head_words + w : from[r] * row_words + rest;
        dst[(h * pool_slots + to[r]) * head_words + w] = src[at];
    }
}
"""


def _modules():
    try:
        from cuda.bindings import driver, nvrtc, runtime
    except ImportError as exc:
        raise MissingDependencyError(
            f"the CUDA runtime needs cuda-python ('cuda.bindings'): {exc}; pip install 'cuda-python>=12.6'") from exc
    return runtime, driver, nvrtc


def check(result):
    """Raise on a failed cuda-python call; return the call's value(s) after the status."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed: {err!r}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


class Stream:
    def __init__(self) -> None:
        rt, _, _ = _modules()
        self._rt = rt
        self.stream = check(rt.cudaStreamCreate())

    @property
    def handle(self) -> int:
        return int(self.stream)

    def synchronize(self) -> None:
        check(self._rt.cudaStreamSynchronize(self.stream))


class DeviceArray:
    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        rt, _, _ = _modules()
        self._rt = rt
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.ptr = int(check(rt.cudaMalloc(max(self.nbytes, 1))))

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: np.dtype) -> DeviceArray:
        return cls(shape, dtype)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: np.dtype) -> DeviceArray:
        arr = cls(shape, dtype)
        check(arr._rt.cudaMemset(arr.ptr, 0, arr.nbytes))
        return arr

    def copy_from_host(self, host: np.ndarray, stream: Stream | None = None) -> None:
        assert host.nbytes <= self.nbytes and host.flags.c_contiguous
        kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        if stream is None:
            check(self._rt.cudaMemcpy(self.ptr, host.ctypes.data, host.nbytes, kind))
        else:
            check(self._rt.cudaMemcpyAsync(self.ptr, host.ctypes.data, host.nbytes, kind, stream.stream))

    def copy_to_host(self, host: PinnedArray | np.ndarray, rows: int | None = None,
                     stream: Stream | None = None) -> None:
        arr = host.array if isinstance(host, PinnedArray) else host
        nbytes = arr.nbytes if rows is None else rows * (arr.nbytes // arr.shape[0])
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        if stream is None:
            check(self._rt.cudaMemcpy(arr.ctypes.data, self.ptr, nbytes, kind))
        else:
            check(self._rt.cudaMemcpyAsync(arr.ctypes.data, self.ptr, nbytes, kind, stream.stream))

    def to_numpy(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        self.copy_to_host(out)
        return out

    def free(self) -> None:
        if self.ptr:
            check(self._rt.cudaFree(self.ptr))
            self.ptr = 0


class PinnedArray:
    """Page-locked host memory, viewed as a numpy array (fast, truly asynchronous copies)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        import ctypes

        rt, _, _ = _modules()
        self._rt = rt
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        self.ptr = int(check(rt.cudaMallocHost(max(nbytes, 1))))
        buf = (ctypes.c_byte * nbytes).from_address(self.ptr)
        self.array = np.frombuffer(memoryview(buf).cast("B"), dtype=dtype).reshape(shape)

    def free(self) -> None:
        if self.ptr:
            self.array = np.empty(0)
            check(self._rt.cudaFreeHost(self.ptr))
            self.ptr = 0


class PoolKernels:
    """``move_rows`` compiled with NVRTC for the current GPU: scatter and block copies over the pools of ``bind``."""

    THREADS = 256

    def __init__(self) -> None:
        rt, drv, nvrtc = _modules()
        self._drv = drv
        check(rt.cudaFree(0))  # make the runtime's primary context current for the driver API
        props = check(rt.cudaGetDeviceProperties(0))
        arch = f"--gpu-architecture=compute_{props.major}{props.minor}".encode()
        prog = check(nvrtc.nvrtcCreateProgram(SCATTER_SOURCE.encode(), b"pool_kernels.cu", 0, [], []))
        try:
            status = nvrtc.nvrtcCompileProgram(prog, 2, [arch, b"--std=c++17"])
            if int(status[0]) != 0:
                size = check(nvrtc.nvrtcGetProgramLogSize(prog))
                log = b" " * size
                check(nvrtc.nvrtcGetProgramLog(prog, log))
                raise RuntimeError(f"NVRTC failed to compile the pool kernels: {log.decode(errors='replace')}")
            size = check(nvrtc.nvrtcGetPTXSize(prog))
            ptx = b" " * size
            check(nvrtc.nvrtcGetPTX(prog, ptx))
        finally:
            check(nvrtc.nvrtcDestroyProgram(prog))
        image = np.frombuffer(ptx, dtype=np.uint8)  # NUL-terminated PTX text, passed by address
        self.module = check(drv.cuModuleLoadData(image.ctypes.data))
        self._image = image
        self.function = check(drv.cuModuleGetFunction(self.module, b"move_rows"))
        self.sm_count = int(props.multiProcessorCount)
        self._rows = {"scatter": _SlotPairs(), "copy": _SlotPairs()}  # own staging each: no reuse in flight
        self._table: DeviceArray | None = None
        self._params: dict[str, tuple[tuple[int, int], list[np.ndarray], np.ndarray]] = {}  # by use
        self._pairs = self._kv_heads = self._head_words = self._pool_slots = 0

    def bind(self, pairs: list[tuple[DeviceArray, DeviceArray]]) -> None:
        """Fix the (step output, pool) pairs every launch serves: pools ``[kv_heads, num_blocks, block_size,
        head_dim]`` of one shape and dtype, outputs ``[rows, kv_heads * head_dim]`` of that dtype."""
        if not pairs:
            raise ValueError("the pool kernels need at least one (output, pool) pair")
        shape, dtype = pairs[0][1].shape, pairs[0][1].dtype
        for src, dst in pairs:
            if dst.shape != shape or dst.dtype != dtype or src.dtype != dtype or src.shape[-1] != shape[0] * shape[3]:
                raise ValueError(f"pool pairs differ: output {src.shape} {src.dtype}, pool {dst.shape} {dst.dtype}; "
                                 f"expected pools {shape} {dtype} and outputs [rows, {shape[0] * shape[3]}]")
        if self._table is not None:
            self._table.free()
        self._params.clear()
        self._table = DeviceArray.empty((2, len(pairs)), np.dtype(np.uint64))
        self._table.copy_from_host(np.array([[s.ptr for s, _ in pairs], [d.ptr for _, d in pairs]], np.uint64))
        self._pairs, self._kv_heads = len(pairs), shape[0]
        self._head_words = shape[3] * dtype.itemsize // 4
        self._pool_slots = shape[1] * shape[2]

    def set_rows(self, src_rows: np.ndarray, dst_rows: np.ndarray, stream: Stream) -> None:
        """Upload this step's mapping, token row -> pool slot (block * block_size + offset), for the next launch."""
        self._rows["scatter"].upload(src_rows, dst_rows, stream)

    def __call__(self, stream: Stream) -> None:
        """Every bound pool <- its output's token rows (the rows of the last ``set_rows``), one launch on ``stream``."""
        self._launch("scatter", stream)

    def copy_blocks(self, pairs: list[tuple[int, int]], block_size: int, stream: Stream) -> None:
        """In every bound pool, block ``src`` copied to block ``dst`` for each pair, one launch on ``stream``."""
        if not pairs:
            return
        self._rows["copy"].upload(*block_slots(pairs, block_size), stream)
        self._launch("copy", stream)

    def _launch(self, name: str, stream: Stream) -> None:
        rows = self._rows[name]
        if rows.n == 0 or rows.idx is None:
            return
        if self._table is None:
            raise RuntimeError("bind the pool kernels' (output, pool) pairs before launching them")
        cap = rows.idx.shape[1]
        where = (rows.idx.ptr, cap)  # a regrown slot buffer may reuse the address with another capacity
        cached = self._params.get(name)
        if cached is None or cached[0] != where:  # built once per binding and slot buffer, not per step
            table = self._table.ptr
            values: list[np.ndarray] = [
                np.array([table], np.uint64), np.array([table + 8 * self._pairs], np.uint64),
                np.array([rows.idx.ptr], np.uint64), np.array([rows.idx.ptr + 8 * cap], np.uint64),
                np.array([0], np.int32), np.array([self._kv_heads], np.int32), np.array([self._head_words], np.int32),
                np.array([self._pool_slots], np.int64), np.array([name == "copy"], np.int32)]
            self._params[name] = (where, values, np.array([v.ctypes.data for v in values], dtype=np.uint64))
        _, values, params = self._params[name]
        values[4][0] = rows.n  # the one argument a step changes
        blocks = max(1, min(-(-rows.n * self._kv_heads * self._head_words // self.THREADS), 4 * self.sm_count))
        check(self._drv.cuLaunchKernel(self.function, blocks, self._pairs, 1, self.THREADS, 1, 1, 0,
                                       stream.handle, params.ctypes.data, 0))

    def free(self) -> None:
        for rows in self._rows.values():
            rows.free()
        self._params.clear()
        if self._table is not None:
            self._table.free()
            self._table = None


class _SlotPairs:
    """Two int64 rows of slots on the device, uploaded through a pinned twin that grows as needed. The
    next upload rewrites the twin, so the stream must have done the last copy by then (the runner
    synchronizes after every step and every block copy)."""

    def __init__(self) -> None:
        self.idx: DeviceArray | None = None
        self._staging: PinnedArray
        self.n = 0

    def upload(self, first: np.ndarray, second: np.ndarray, stream: Stream) -> None:
        n = int(len(first))
        if self.idx is None or self.idx.shape[1] < n:
            self.free()
            cap = max(n, 256)
            self.idx = DeviceArray.empty((2, cap), np.dtype(np.int64))
            self._staging = PinnedArray((2, cap), np.dtype(np.int64))
        self._staging.array[0, :n] = first
        self._staging.array[1, :n] = second
        self.n = n
        cap = self.idx.shape[1]
        kind = self.idx._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        check(self.idx._rt.cudaMemcpyAsync(self.idx.ptr, self._staging.ptr, 16 * cap, kind, stream.stream))

    def free(self) -> None:
        if self.idx is not None:
            self.idx.free()
            self._staging.free()
            self.idx = None
