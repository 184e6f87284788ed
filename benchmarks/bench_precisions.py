#!/usr/bin/env python3
"""Speed of each precision of SmolLM2-135M side by side, one run: greedy decode at batch 1 and 8
and the prefill of a 1,000-token prompt, for the fp32, int8 (W8A8), int8-wo, int8-dyn and int4-awq
engines, and int4-awq built with ``--int4-gate 1.04`` (int4-awq-gate).

    python -m benchmarks.bench_precisions [--rounds 3] [--gen 64] [--native-variant avx2] [--json OUT]

Decode rate = tokens after the first / time after the first, summed over the batch (prompts of
32 random token ids, EOS ignored); prefill = time to the first token of a new 1,000-token prompt
(random ids, so no prefix is cached). Rounds interleave every measurement; each figure is the
median over rounds, each ratio (against int8) the median of the rounds' ratios. Engines are built
first if missing (``bench_runtime.ensure_engine``). ``engine_mb``: the engine directory's files
on disk (its graphs, their weights, the native operators' packed copy, tokenizer).
``--native-variant``: run a given build of the native library (``avx2``: the kernels of a CPU without
AVX-512, where no precision has VNNI's 8-bit dot products) instead of the best this CPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from .common import machine

PRECISIONS = ("fp32", "int8", "int8-wo", "int8-dyn", "int4-awq", "int4-awq-gate")


def main() -> None:
    from autoglm_trt.runtime import Engine, SamplingParams

    from .bench_genai import engine_rate
    from .bench_runtime import ensure_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--native-variant", default=None, help="a build of the native library by name (avx2, ...)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from autoglm_trt import native

    if args.native_variant:
        os.environ[native.ENV_VARIANT] = args.native_variant  # before any engine loads the library
    path, why = native.library()
    if args.native_variant and (path is None or args.native_variant not in path.name):
        ap.error(f"the native build {args.native_variant!r} cannot run here: {why or path}")
    dirs = {p: ensure_engine(p) for p in PRECISIONS}
    engines = {p: Engine.load(d) for p, d in dirs.items()}
    rng = np.random.default_rng(0)
    vocab = engines["fp32"].spec.vocab_size
    figures: dict[str, dict[str, list[float]]] = {p: {"batch1": [], "batch8": [], "ttft_ms": []} for p in PRECISIONS}
    try:
        for _ in range(args.rounds):
            prompts = {b: rng.integers(100, vocab, (b, 32)) for b in (1, 8)}
            long = rng.integers(100, vocab, 1000).tolist()
            for p, engine in engines.items():
                for b in (1, 8):
                    figures[p][f"batch{b}"].append(engine_rate(engine, prompts[b], args.gen))
                res = engine.generate([long], SamplingParams(max_new_tokens=1))[0]
                figures[p]["ttft_ms"].append(1000 * res.ttft)
    finally:
        for engine in engines.values():
            engine.close()
    out = {}
    for p in PRECISIONS:
        out[p] = {k: round(float(np.median(v)), 1) for k, v in figures[p].items()}
        out[p].update({f"{k}_vs_int8": round(float(np.median(np.array(v) / np.array(figures["int8"][k]))), 3)
                       for k, v in figures[p].items()})
        out[p]["engine_mb"] = round(sum(f.stat().st_size for f in dirs[p].iterdir() if f.is_file()) / 1e6)
        print(json.dumps({"precision": p, **out[p]}), flush=True)
    print(machine(), "| native library:", path.name if path else f"none ({why})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
