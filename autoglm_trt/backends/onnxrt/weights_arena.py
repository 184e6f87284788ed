"""One buffer for the weights the native operators stream, on transparent huge pages where Linux
offers them.

A batch-1 decode step of an INT8 engine reads every packed weight once, front to back, and is
bound by how fast memory streams. On 4 KiB pages that stream crosses a page boundary every
4 KiB: a TLB miss each time (and hardware prefetchers generally start over at page boundaries).
On 2 MiB pages it crosses one every 2 MiB. On this project's 2-core machine the SmolLM2 INT8
engine's ``Int8Linear`` shapes, chained in one graph with their weights bound in place, streamed
their weights measurably faster from huge pages than from 4 KiB ones.

ONNX Runtime copies initializers handed to it with ``add_external_initializers`` (and those it
reads from files) into memory of its own, so the engine's packed weights are not handed over
that way: they live here, in one buffer the runner owns, aligned to
2 MiB and advised ``MADV_HUGEPAGE`` before they are written, then ``MADV_COLLAPSE`` (Linux 6.1+)
for any part the kernel first gave small pages. The session reads them in place
(``backends.onnxrt.session``'s ``initializers``). Each step is best effort: where the system has no
transparent huge pages (``never``, another OS), the weights sit on ordinary pages and only the
speed differs (``AnonHugePages`` in ``/proc/self/smaps`` says what the kernel did).
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

HUGE_PAGE = 2 << 20
ALIGN = 64  # each array starts on a cache line
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>


def _madvise(buf: np.ndarray, advice: int) -> bool:
    if not sys.platform.startswith("linux") or buf.nbytes == 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(buf.ctypes.data, buf.nbytes, advice) == 0
    except (OSError, AttributeError):
        return False


def layout(arrays: list[tuple[tuple[int, ...], np.dtype]]) -> tuple[list[int], int]:
    """Offsets of arrays of these shapes and dtypes in one buffer, each on a cache line, and the
    buffer's size rounded up to whole huge pages."""
    offsets, end = [], 0
    for shape, dtype in arrays:
        offsets.append(end)
        end += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
    return offsets, -(-end // HUGE_PAGE) * HUGE_PAGE


def allocate(nbytes: int) -> np.ndarray:
    """``nbytes`` (uint8) starting on a 2 MiB boundary, advised for huge pages, not yet touched."""
    raw = np.empty(nbytes + HUGE_PAGE, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    buf = raw[start:start + nbytes]
    _madvise(buf, MADV_HUGEPAGE)
    return buf


def views(buf: np.ndarray, arrays: list[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Arrays of these shapes and dtypes over ``buf`` at ``layout``'s offsets; the bytes between
    them zeroed, so that a saved arena (``model.native.bin``) is the same file every build."""
    offsets, _ = layout(arrays)
    out = []
    for offset, (shape, dtype) in zip(offsets, arrays):
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buf[offset + n:offset - (-n // ALIGN) * ALIGN] = 0
        out.append(buf[offset:offset + n].view(dtype).reshape(shape))
    return out


def settle(buf: np.ndarray) -> bool:
    """Once written: ask the kernel to move any small pages of ``buf`` onto huge pages now
    (``MADV_COLLAPSE``); False where it could not (an older kernel, no huge pages free)."""
    return _madvise(buf, MADV_COLLAPSE)
