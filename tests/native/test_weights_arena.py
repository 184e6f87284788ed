"""The packed INT8 weights' buffer: its layout, its huge-page advice, and that the engine's session
reads it in place."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from autoglm_trt.backends.onnxrt import weights_arena
from autoglm_trt.native import library as native_library


def test_layout_puts_each_array_on_a_cache_line_and_rounds_to_huge_pages():
    specs = [((3, 5), np.dtype(np.int8)), ((7,), np.dtype(np.int32)), ((64,), np.dtype(np.int8)), ((1,), np.dtype(np.int8))]
    offsets, size = weights_arena.layout(specs)
    assert offsets == [0, 64, 128, 192] and size == 2 << 20
    assert weights_arena.layout([(((2 << 20) + 1,), np.dtype(np.int8))])[1] == 4 << 20
    buf = weights_arena.allocate(size)
    assert buf.nbytes == size and buf.ctypes.data % (2 << 20) == 0
    buf[...] = 0  # allocate leaves the memory as it finds it
    arrays = weights_arena.views(buf, specs)
    for a, (shape, dtype) in zip(arrays, specs):
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.base is not None
        a[...] = 7
    assert np.count_nonzero(buf) == 15 + 7 + 64 + 1  # an int32 7 has one nonzero byte; no array overlaps another


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="this system has no transparent huge pages to advise (Linux with THP always or madvise)")
def test_the_buffer_is_advised_for_huge_pages():
    buf = weights_arena.allocate(4 << 20)
    start = buf.ctypes.data
    flags = None
    for block in Path("/proc/self/smaps").read_text().split("\n"):
        head = block.split()[0] if block.split() else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start < hi
        elif inside and head == "VmFlags:":
            flags = block.split()[1:]
            break
    assert flags is not None and "hg" in flags  # MADV_HUGEPAGE on the mapping (how many huge pages the
    # kernel gives depends on free memory, and smaps counts them per mapping, not per buffer)


def test_the_engine_session_reads_the_packed_weights_in_place(tiny_int8_engine, monkeypatch):
    """Changing the buffer changes the logits: the session holds no copy of its own."""
    from conftest import logits_over_steps

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends import open_runner

    if native_library()[0] is None:
        pytest.skip(f"the native operators cannot be built here: {native_library()[1]}")
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "1")
    manifest = Manifest.read(tiny_int8_engine)
    runners = [open_runner(manifest, num_blocks=32, threads=1) for _ in range(2)]
    arrays = list(runners[1].session.in_place_initializers.values())
    assert arrays and len({a.base.ctypes.data for a in arrays}) == 1  # one buffer
    first = next(logits_over_steps(runners, steps=1))
    np.testing.assert_array_equal(*first)
    for runner in runners:
        runner.pools.data[...] = 0
    for a in arrays:
        if a.dtype == np.int8:
            a[...] = 0  # every INT8 weight now zero
    changed = next(logits_over_steps(runners, steps=1))
    np.testing.assert_array_equal(changed[0], first[0])
    assert not np.array_equal(changed[1], first[1])
    for runner in runners:
        runner.close()


def test_the_bytes_between_arrays_are_zero_whatever_the_buffer_held():
    """A saved arena is the same file every build: the padding after each array (to the next cache
    line) is zeroed, not left as whatever the fresh buffer held."""
    arrays = [((3, 5), np.dtype(np.int8)), ((7,), np.dtype(np.int32)), ((2, 2), np.dtype(np.uint8))]
    offsets, size = weights_arena.layout(arrays)
    buf = np.full(size, 0xA5, np.uint8)
    for view in weights_arena.views(buf, arrays):
        view.view(np.uint8)[...] = 1
    used = np.zeros(size, bool)
    for offset, (shape, dtype) in zip(offsets, arrays):
        used[offset:offset + int(np.prod(shape)) * dtype.itemsize] = True
    end = offsets[-1] + 4
    assert (buf[:end][used[:end]] == 1).all() and not buf[:end][~used[:end]].any()
