"""The CUDA side of the TensorRT runtime on a GPU, checked against numpy.

    pytest tests/gpu                                  # the checks as tests (skipped without a GPU)
    PYTHONPATH=. python tests/gpu/test_cuda_runtime.py [--json OUT]  # the same checks as a table, with timings
    python scripts/gpu_check.py --out DIR             # both, plus compute-sanitizer, on a lent GPU

Needs an NVIDIA GPU and cuda-python (``cuda.bindings`` with NVRTC); TensorRT is not needed.
Checks, each with fresh random data (never zeros; outputs poisoned first):
  1. device pool allocation: K/V pools of a SmolLM2-sized engine (30 layers, 3 KV heads x 64)
     in float16 and float32, zero-initialised, read back;
  2. pinned transfers: host -> device -> host round trip through page-locked buffers on a stream;
  3. the NVRTC scatter kernel: new K/V of a mixed step (prefill + decode rows, arbitrary block
     ids and offsets) written into the K and V pools of two layers by one launch, compared element
     for element with the same scatter done by numpy (``kvcache.host_pools.KVPools.write``),
     untouched slots checked unchanged;
  4. the TensorRT runner's input path: step inputs staged through pinned buffers;
  5. copy-on-write block copies in the K and V pools of two layers by one launch (as
     ``TrtRunner.copy_blocks`` makes them) against ``KVPools.copy_blocks``;
  6. host time over 60 pools (K and V of 30 layers): a batch-16 decode step's scatter, one launch
     for all pools against a launch per pool; four block copies, one launch against a 2-D memcpy
     per pool and pair.
Prints a table and exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from autoglm_trt.backends.trt import cuda as cu
from autoglm_trt.kvcache.host_pools import KVPools
from autoglm_trt.kvcache.layout import pool_shape
from autoglm_trt.kvcache.step_inputs import SeqState, step_inputs

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def _gpu() -> bool:
    import importlib.util

    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return False
    from cuda.bindings import runtime

    err, count = runtime.cudaGetDeviceCount()
    return int(err) == 0 and count > 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU and cuda-python "
                                                                      "(cuda.bindings); none on the CI machines")]


def check_pools(dtype: np.dtype, num_blocks: int) -> dict:
    pool = cu.DeviceArray.zeros(pool_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype)
    host = pool.to_numpy()
    ok = bool(host.shape == pool.shape and not host.any())
    pool.free()
    return {"check": f"pool zeros {dtype.name}", "ok": ok, "bytes": int(host.nbytes)}


def check_pinned(rng: np.random.Generator) -> dict:
    stream = cu.Stream()
    n = 1 << 22
    src = cu.PinnedArray((n,), np.dtype(np.float32))
    src.array[:] = rng.standard_normal(n, dtype=np.float32)
    dst = cu.PinnedArray((n,), np.dtype(np.float32))
    dst.array[:] = np.nan
    dev = cu.DeviceArray.empty((n,), np.dtype(np.float32))
    t = time.perf_counter()
    dev.copy_from_host(src.array, stream)
    dev.copy_to_host(dst, None, stream)
    stream.synchronize()
    secs = time.perf_counter() - t
    ok = bool(np.array_equal(src.array, dst.array))
    for a in (src, dst):
        a.free()
    dev.free()
    return {"check": "pinned round trip 16 MiB", "ok": ok, "GB/s": round(2 * n * 4 / secs / 1e9, 2)}


def check_staged_inputs(rng: np.random.Generator) -> dict:
    """The TensorRT runner's input path: a step's smaller input copied through the front of a
    pinned buffer sized for the engine's limits, asynchronously, then read back."""
    stream = cu.Stream()
    host = cu.PinnedArray((16, 1024), np.dtype(np.int64))
    dev = cu.DeviceArray.empty((16, 1024), np.dtype(np.int64))
    ok = True
    for shape in ((3, 37), (16, 1), (1, 1024)):
        arr = rng.integers(0, 49152, shape)
        flat = host.array.reshape(-1)[: arr.size]
        flat[:] = arr.reshape(-1)
        dev.copy_from_host(flat, stream)
        stream.synchronize()
        back = np.empty(arr.size, np.int64)
        dev.copy_to_host(back)
        ok = ok and bool(np.array_equal(back, arr.reshape(-1)))
    host.free()
    dev.free()
    return {"check": "pinned staging of step inputs", "ok": ok, "shapes": 3}


def scatter_case(rng: np.random.Generator, dtype: np.dtype, num_blocks: int) -> dict:
    """One launch scatters a mixed step into the K and V pools of two layers (four pools, each
    with its own new rows); compared with ``KVPools.write``, untouched slots checked unchanged."""
    # a mixed step: one prefill of 37 tokens after 5 cached, one decode at position 70, one of 1 token
    blocks = rng.permutation(num_blocks)
    states = [SeqState(5, blocks[0:3].tolist()), SeqState(70, blocks[3:8].tolist()), SeqState(0, blocks[8:9].tolist())]
    new_tokens = [rng.integers(0, 1000, 37).tolist(), [1], [2]]
    _, slots = step_inputs(new_tokens, states, BLOCK)
    batch, tokens, layers = 3, 37, 2
    ref = KVPools(layers, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype)
    for pool in [*ref.keys, *ref.values]:
        pool[:] = rng.standard_normal(pool.shape).astype(dtype)  # poison: random, not zeros
    before = [p.copy() for p in [*ref.keys, *ref.values]]
    new = {f"new_{kind}.{i}": rng.standard_normal((batch, tokens, KV_HEADS, HEAD_DIM)).astype(dtype)
           for i in range(layers) for kind in ("key", "value")}
    ref.write(new, slots)
    names = [f"new_key.{i}" for i in range(layers)] + [f"new_value.{i}" for i in range(layers)]

    stream = cu.Stream()
    pools, srcs = [], []
    for name, host in zip(names, before):
        pools.append(cu.DeviceArray.empty(host.shape, dtype))
        pools[-1].copy_from_host(host)
        srcs.append(cu.DeviceArray.empty((batch * tokens, KV_HEADS * HEAD_DIM), dtype))
        srcs[-1].copy_from_host(np.ascontiguousarray(new[name].reshape(batch * tokens, -1)))
    kernel = cu.PoolKernels()
    kernel.bind(list(zip(srcs, pools)))
    kernel.set_rows(slots.batch * tokens + slots.token, slots.block * BLOCK + slots.offset, stream)
    kernel(stream)
    stream.synchronize()
    untouched = np.ones(before[0].shape[:3], bool)  # [kv_heads, num_blocks, block_size]
    untouched[:, slots.block, slots.offset] = False
    ok = True
    for pool, want, old in zip(pools, [*ref.keys, *ref.values], before):
        got = pool.to_numpy()
        ok = ok and bool(np.array_equal(got, want) and np.array_equal(got[untouched], old[untouched]))
    for a in pools + srcs:
        a.free()
    kernel.free()
    return {"check": f"scatter {dtype.name}, 4 pools, one launch", "ok": ok, "rows": int(len(slots.block))}


def block_copy_case(rng: np.random.Generator, dtype: np.dtype, num_blocks: int) -> dict:
    """Copy-on-write copies of four blocks in the K and V pools of two layers, one launch
    (``PoolKernels.copy_blocks``, as ``TrtRunner.copy_blocks`` makes them), against ``KVPools.copy_blocks``."""
    ref = KVPools(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype)
    ref.data[:] = rng.standard_normal(ref.data.shape).astype(dtype)
    stream = cu.Stream()
    pools = []
    for host in [*ref.keys, *ref.values]:
        pools.append(cu.DeviceArray.empty(host.shape, dtype))
        pools[-1].copy_from_host(np.ascontiguousarray(host))
    src = cu.DeviceArray.empty((1, KV_HEADS * HEAD_DIM), dtype)
    blocks = rng.permutation(num_blocks)
    pairs = list(zip(blocks[:4].tolist(), blocks[4:8].tolist()))
    ref.copy_blocks(pairs)
    kernel = cu.PoolKernels()
    kernel.bind([(src, pool) for pool in pools])
    kernel.copy_blocks(pairs, BLOCK, stream)
    stream.synchronize()
    ok = all(bool(np.array_equal(pool.to_numpy(), want)) for pool, want in zip(pools, [*ref.keys, *ref.values]))
    for a in [*pools, src]:
        a.free()
    kernel.free()
    return {"check": f"block copy {dtype.name}, 4 pools, one launch", "ok": ok, "pairs": len(pairs)}


def copy_2d(pools: list, pairs: list[tuple[int, int]], num_blocks: int, dtype: np.dtype, stream) -> None:
    """The copies as one 2-D memcpy per pool and pair (a block is one span per head, ``num_blocks``
    spans apart): the way without a kernel, timed against it."""
    span = BLOCK * HEAD_DIM * dtype.itemsize
    rt = pools[0]._rt
    for pool in pools:
        for s, d in pairs:
            cu.check(rt.cudaMemcpy2DAsync(pool.ptr + d * span, num_blocks * span, pool.ptr + s * span,
                                          num_blocks * span, span, KV_HEADS,
                                          rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream.stream))


def time_pool_kernels(rng: np.random.Generator, num_blocks: int) -> dict:
    """60 pools (K and V of 30 layers): a batch-16 decode step's scatter, one launch against 60 launches
    of one pool each; 4 block copies, one launch against 240 2-D memcpys; host time per step, one run."""
    dtype = np.dtype(np.float16)
    stream = cu.Stream()
    pools = [cu.DeviceArray.zeros(pool_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype) for _ in range(2 * LAYERS)]
    src = cu.DeviceArray.empty((16, KV_HEADS * HEAD_DIM), dtype)
    src.copy_from_host(rng.standard_normal((16, KV_HEADS * HEAD_DIM)).astype(dtype))
    dst_rows = rng.choice(num_blocks * BLOCK, 16, replace=False)
    blocks = rng.permutation(num_blocks)
    pairs = list(zip(blocks[:4].tolist(), blocks[4:8].tolist()))
    every, single = cu.PoolKernels(), cu.PoolKernels()
    every.bind([(src, p) for p in pools])
    single.bind([(src, pools[0])])
    for kernel in (every, single):
        kernel.set_rows(np.arange(16), dst_rows, stream)
    steps = {"scatter one launch": lambda: every(stream), "scatter 60 launches": lambda: [single(stream) for _ in pools],
             "copy one launch": lambda: every.copy_blocks(pairs, BLOCK, stream),
             "copy 240 memcpy2D": lambda: copy_2d(pools, pairs, num_blocks, dtype, stream)}
    row: dict = {"check": "timing, 60 pools: scatter of 16 rows, 4 block copies", "ok": True}
    for label, run in steps.items():
        for _ in range(10):
            run()
        stream.synchronize()
        reps = 200
        t = time.perf_counter()
        for _ in range(reps):
            run()
        stream.synchronize()
        row[f"us/step {label}"] = round((time.perf_counter() - t) / reps * 1e6, 1)
    for p in [*pools, src]:
        p.free()
    for kernel in (every, single):
        kernel.free()
    return row


def checks() -> list:
    """Every check, in order, with one random stream (the script's table)."""
    rng = np.random.default_rng(0)
    return [lambda: check_pools(np.dtype(np.float16), 4096), lambda: check_pools(np.dtype(np.float32), 4096),
            lambda: check_pinned(rng), lambda: check_staged_inputs(rng),
            lambda: scatter_case(rng, np.dtype(np.float16), 64), lambda: scatter_case(rng, np.dtype(np.float32), 64),
            lambda: block_copy_case(rng, np.dtype(np.float16), 64), lambda: block_copy_case(rng, np.dtype(np.int8), 64),
            lambda: time_pool_kernels(rng, 4096)]


@pytest.mark.parametrize("index", range(9))
def test_check(index: int) -> None:  # pragma: no cover - GPU machines only
    row = checks()[index]()
    assert row["ok"], row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-timing", action="store_true", help="the correctness checks only (under compute-sanitizer)")
    args = ap.parse_args()
    rows = [check() for check in checks()[: 8 if args.no_timing else None]]
    for r in rows:
        extra = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("check", "ok"))
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']:45s} {extra}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
