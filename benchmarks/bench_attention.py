#!/usr/bin/env python3
"""Decode-step time with the native operators against the graph's own nodes.

    python -m benchmarks.bench_attention [--engine engines/smollm2-int8] [--contexts 128,1000] [--batches 1,8,16]

Both sessions are the ONNX Runtime runner's (``OrtRunner``), loaded once with the native
operators (``PagedAttention`` for decode steps; ``HadamardQuantize`` for each INT8 linear's
input rotation and quantization) and once with ``AUTOGLM_TRT_NATIVE=0``; everything else in
their graphs (the residual + RMSNorm fusion included) is the same. Each step is
one decode step (one new token per sequence) of ``batch`` sequences with ``context`` cached
tokens each, over pools of random K/V, 2 ONNX Runtime threads; the native session's attention
operator also stores the new tokens' K/V in the pools, which the graph's form leaves to the
runner (and this timing leaves out). Rounds interleave the two;
the figures are medians over rounds and each ratio the median of the per-round ratios. Prints
the CPU model and one JSON line per (context, batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from .common import ROOT


def runner_session(engine: Path, native: bool, threads: int):
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends import open_runner

    manifest = Manifest.read(engine)
    os.environ["AUTOGLM_TRT_NATIVE"] = "1" if native else "0"
    try:
        runner = open_runner(manifest, 1, threads)
    finally:
        del os.environ["AUTOGLM_TRT_NATIVE"]
    return runner, manifest.spec


def main() -> None:
    from autoglm_trt.backends.onnxrt.passes.common import SLOTS
    from autoglm_trt.fileutil import cpu_model

    from .common import decode_feeds, run_ms

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "smollm2-int8")
    ap.add_argument("--contexts", default="128,1000")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    native, spec = runner_session(args.engine, True, args.threads)
    graph, _ = runner_session(args.engine, False, args.threads)
    if native.attention != "native":
        sys.exit(f"the native operator cannot run here: {native.attention}")
    print(f"CPU: {cpu_model()}; {args.engine.name}; decode step ms, {args.threads} threads, "
          f"median of {args.rounds} rounds")
    for ctx in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            # one set of pools for both: the native session's stores go past every context the steps read
            stored = decode_feeds(spec, batch, ctx, block_size=native.block_size, slots=native.stores_kv)
            feeds = {name: arr for name, arr in stored.items() if name != SLOTS}
            rounds = [(run_ms(native.session, stored, runs=20), run_ms(graph.session, feeds, runs=20))
                      for _ in range(args.rounds)]
            row = {"context": ctx, "batch": batch,
                   "native_ms": round(statistics.median(r[0] for r in rounds), 2),
                   "graph_ms": round(statistics.median(r[1] for r in rounds), 2),
                   "graph_over_native": round(statistics.median(r[1] / r[0] for r in rounds), 3)}
            print(json.dumps(row), flush=True)
    native.close()
    graph.close()


if __name__ == "__main__":
    main()
