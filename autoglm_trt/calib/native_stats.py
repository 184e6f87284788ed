"""The statistics pass's per-batch work in the native library (``csrc/calib_stats.c``), on every core.

After each batch, each histogram takes its token rows of one tensor (the SmoothQuant vector
applied and the Hadamard rotation done for the Q/DQ graph's histograms), and adds their
absolute values. numpy does that in several passes over memory on one core
(``collect.Accumulator``'s fallback); here it is a C pass that takes, scales, rotates and makes
the rows absolute, and one that bins them, run on a thread pool (ctypes and numpy let go of the
GIL), one histogram per task. The rotation is ``quant.hadamard.rotate_rows``' butterfly in
float64, the same operations in the same order, so the values, maxima and counts are those of
the numpy path, bit for bit.

``native_stats()`` is ``None`` where no build of the native library is installed (no C compiler then, or
``AUTOGLM_TRT_NATIVE=0``); calibration then takes the numpy path.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ..quant.hadamard import hadamard
from .histogram import AbsHistogram

_F32 = np.dtype(np.float32)
T = TypeVar("T")
R = TypeVar("R")
_lock = threading.Lock()
_loaded: list[NativeStats | None] = []


@dataclass
class HistogramJob:
    """One histogram's share of a batch: rows of ``x`` ([windows, tokens, channels] or [windows,
    channels], channels contiguous), one token row in ``stride`` per window, times ``scale``
    (per channel) and rotated in blocks of ``block`` (0: none) before the absolute value."""

    hist: AbsHistogram
    x: np.ndarray
    stride: int = 1
    scale: np.ndarray | None = None
    block: int = 0


class NativeStats:
    def __init__(self, library: str):
        lib = ctypes.CDLL(library)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._rows = lib.AutoglmTakeRows
        self._rows.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, i64, ctypes.c_double, ptr]
        self._rows.restype = ctypes.c_float
        self._bin = lib.AutoglmBinCount
        self._bin.argtypes = [ptr, i64, ctypes.c_float, ptr, i64]
        self._bin.restype = None
        self._rotate = lib.AutoglmRotateRows
        self._rotate.argtypes = [ptr, i64, i64, ctypes.c_double, ptr]
        self._rotate.restype = ctypes.c_int
        self._scratch = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, 8)),
                                        thread_name_prefix="calib-stats")

    def abs_rows(self, job: HistogramJob, window0: int) -> tuple[np.ndarray, float]:
        """(the values ``job`` adds, flat float32 in this thread's scratch, their max)."""
        x = job.x if job.x.ndim == 3 else job.x[:, None, :]
        windows, tokens, channels = x.shape
        if x.strides[2] != _F32.itemsize or x.dtype != _F32:
            raise ValueError(f"expected float32 rows with contiguous channels, got {x.dtype} strides {x.strides}")
        stride = job.stride if tokens >= job.stride else 1
        n = windows * (tokens // stride) * channels
        buf = self._buffer("rows", n)
        scale = None
        if job.scale is not None:
            scale = np.ascontiguousarray(job.scale, np.float32)
            assert scale.shape == (channels,), (scale.shape, channels)
        block = job.block if job.block > 1 else 0
        entry = _hadamard_entry(channels, block) if block else 0.0
        m = self._rows(x.ctypes.data, windows, tokens, channels, x.strides[1] // 4, x.strides[0] // 4, stride,
                       window0, None if scale is None else scale.ctypes.data, block, entry, buf.ctypes.data)
        if m < 0:
            raise MemoryError(f"no memory for a rotation's work buffer of {block} doubles")
        return buf[:n], float(m)

    def rotate(self, x: np.ndarray, block: int, out: np.ndarray | None = None) -> np.ndarray:
        """``quant.hadamard.rotate_rows(x, block, out)``, bit for bit, in one pass (``out`` may be x)."""
        x = np.ascontiguousarray(x, np.float32)
        entry = _hadamard_entry(x.shape[-1], block)
        if out is None:
            out = np.empty_like(x)
        if out.shape != x.shape or out.dtype != _F32 or not out.flags.c_contiguous:
            raise ValueError(f"rotate's out must be C-contiguous float32 of shape {x.shape}")
        if self._rotate(x.ctypes.data, x.size, block, entry, out.ctypes.data) != 0:
            raise MemoryError(f"no memory for a rotation's work buffer of {block} doubles")
        return out

    def _buffer(self, use: str, n: int) -> np.ndarray:
        """This thread's float32 scratch for ``use``, at least n values."""
        buf = getattr(self._scratch, use, None)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1), np.float32)
            setattr(self._scratch, use, buf)
        return buf[:n]

    def bin_count(self, a: np.ndarray, inv_width: np.float32, fine: np.ndarray) -> None:
        """``fine[min(trunc(a * inv_width), fine.size - 1)] += 1`` (a float32, >= 0)."""
        assert a.dtype == _F32 and a.flags.c_contiguous and fine.dtype == np.int64 and fine.flags.c_contiguous
        self._bin(a.ctypes.data, a.size, float(inv_width), fine.ctypes.data, fine.size)

    def add(self, jobs: Sequence[HistogramJob], window0: int) -> None:
        """Every job's rows into its histogram, in parallel (one histogram per task)."""

        def one(job: HistogramJob) -> None:
            a, m = self.abs_rows(job, window0)
            job.hist.add_abs(a, m, self.bin_count)

        self.map(one, jobs)

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``[fn(item) for item in items]`` on the pool. numpy's BLAS runs one thread per task
        meanwhile: its own threads on top of the pool's oversubscribe the cores (the statistics
        of SmolLM2's windows measured faster with one BLAS thread, in
        ``bench_calibration.py --profile``)."""
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"):
            return [future.result() for future in [self._pool.submit(fn, item) for item in items]]


def _hadamard_entry(channels: int, block: int) -> float:
    """H's entry 1/sqrt(block) as ``quant.hadamard`` has it (float32), for rows of ``channels``
    rotated in blocks of ``block``; a block that is not a power of two dividing them is refused."""
    if block < 1 or block & (block - 1) or channels % block:
        raise ValueError(f"rows of {channels} channels have no Hadamard blocks of {block}")
    return float(hadamard(block)[0, 0])


def native_stats() -> NativeStats | None:
    """The native statistics (built at install time), or None where the library cannot be built."""
    with _lock:
        if not _loaded:
            from ..native import library

            path, _why = library()
            _loaded.append(NativeStats(str(path)) if path is not None else None)
        return _loaded[0]
