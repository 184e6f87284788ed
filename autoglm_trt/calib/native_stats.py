"""The statistics pass's per-batch work in the native library (``csrc/calib_stats.c``), on every core.

After each batch, each histogram takes its token rows of one tensor (the SmoothQuant vector
applied and the Hadamard rotation done for the Q/DQ graph's histograms), and adds their
absolute values. numpy does that in several passes over memory on one core
(``collect.Accumulator``'s fallback); here it is two C calls per histogram, one pass each, run
on a thread pool (ctypes lets go of the GIL), one histogram per task. The counts are those
numpy gives, except that the rotation is a fast Walsh-Hadamard transform instead of a b x b
GEMM: the rotated values differ by float rounding.

``native_stats()`` is ``None`` where the native library cannot be built (no C compiler, or
``AUTOGLM_TRT_NATIVE=0``); calibration then takes the numpy path.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .histogram import AbsHistogram

_F32 = np.dtype(np.float32)
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
        self._rows = lib.AutoglmAbsRows
        self._rows.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, i64, ptr]
        self._rows.restype = ctypes.c_float
        self._bin = lib.AutoglmBinCount
        self._bin.argtypes = [ptr, i64, ctypes.c_float, ptr, i64]
        self._bin.restype = None
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
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.size < n:
            buf = self._scratch.buf = np.empty(max(n, 1), np.float32)
        scale = None
        if job.scale is not None:
            scale = np.ascontiguousarray(job.scale, np.float32)
            assert scale.shape == (channels,), (scale.shape, channels)
        m = self._rows(x.ctypes.data, windows, tokens, channels, x.strides[1] // 4, x.strides[0] // 4, stride,
                       window0, None if scale is None else scale.ctypes.data, job.block, buf.ctypes.data)
        return buf[:n], float(m)

    def bin_count(self, a: np.ndarray, inv_width: np.float32, fine: np.ndarray) -> None:
        """``fine[min(trunc(a * inv_width), fine.size - 1)] += 1`` (a float32, >= 0)."""
        assert a.dtype == _F32 and a.flags.c_contiguous and fine.dtype == np.int64 and fine.flags.c_contiguous
        self._bin(a.ctypes.data, a.size, float(inv_width), fine.ctypes.data, fine.size)

    def add(self, jobs: Sequence[HistogramJob], window0: int) -> None:
        """Every job's rows into its histogram, in parallel (one histogram per task)."""

        def one(job: HistogramJob) -> None:
            a, m = self.abs_rows(job, window0)
            job.hist.add_abs(a, m, self.bin_count)

        for future in [self._pool.submit(one, job) for job in jobs]:
            future.result()


def native_stats() -> NativeStats | None:
    """The native statistics (built on first use), or None where the library cannot be built."""
    with _lock:
        if not _loaded:
            from ..backends.onnxrt.native import native_library

            path, _why = native_library()
            _loaded.append(NativeStats(str(path)) if path is not None else None)
        return _loaded[0]
