"""What the benchmarks share: where the repository is, and what machine a figure was measured on."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from autoglm_trt.fileutil import cpu_model

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """One line: CPU model, cores, memory and the x86 extensions that decide the kernels."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "amx_int8") if f in flags]
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = 0.0
    return f"{cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB, {' '.join(isa) or 'no AVX2'}"


def decode_feeds(spec, batch: int, ctx: int, block_size: int = 16, slots: bool = False) -> dict[str, np.ndarray]:
    """A decode step's inputs (``kvcache.step_inputs``): ``batch`` sequences of ``ctx`` cached tokens
    each, in blocks of their own, over pools of random K/V; with ``slots``, also where the native
    attention operator stores the new tokens' K/V (``native.slots``, an input of the runner's graph)."""
    from autoglm_trt.backends.onnxrt.passes.common import SLOTS
    from autoglm_trt.kvcache.host_pools import KVPools
    from autoglm_trt.kvcache.layout import blocks_needed
    from autoglm_trt.kvcache.step_inputs import SeqState, step_inputs

    nb = blocks_needed(ctx + 1, block_size)
    pools = KVPools(spec.num_layers, batch * nb, block_size, spec.num_kv_heads, spec.head_dim)
    pools.data[:] = np.random.default_rng(0).standard_normal(pools.data.shape, np.float32)
    states = [SeqState(ctx, list(range(b * nb, (b + 1) * nb))) for b in range(batch)]
    feeds, where = step_inputs([[5]] * batch, states, block_size)
    if slots:
        feeds[SLOTS] = where.block * block_size + where.offset
    return {**feeds, **pools.feeds()}


def run_ms(sess, feeds: dict[str, np.ndarray], runs: int = 40) -> float:
    """Mean time of one run in ms, the best of 5 repetitions of ``runs // 5`` runs."""
    for _ in range(5):
        sess.run(None, feeds)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(runs // 5):
            sess.run(None, feeds)
        best = min(best, (time.perf_counter() - t) / (runs // 5))
    return best * 1e3
