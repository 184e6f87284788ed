#!/usr/bin/env python3
"""The token sampler's cost, against the one it replaced, measured in one run on this machine.

    python -m benchmarks.bench_sampling [--engine engines/smollm2-int8] [--rounds 3]

1. Time per token of ``runtime.sampling.sample`` on real logits (64 rows the engine produced
   for a chat prompt; SmolLM2's vocabulary is 49,152) for greedy, temperature 1 (the OpenAI
   API's default, and the server's), temperature 0.7 with top_p 0.9, and temperature 0.8 with
   top_k 40 and top_p 0.95; against ``full_sort``, the sampler before this one (it sorted the
   whole vocabulary for every token), on the same rows; the median over rows, then over rounds.
2. Aggregate tokens/s of 16 concurrent requests (48-token prompts, 64 new tokens, temperature 1,
   seeded) on the engine with this sampler and with ``full_sort`` in its place, and greedy, the
   three alternating in each round; medians over rounds, each ratio the median of its rounds'.
Prints the CPU model. The engine is built first if missing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .common import ROOT

DEFAULT_ENGINE = ROOT / "engines" / "smollm2-int8"  # built by bench_runtime.ensure_engine if missing
PARAMS = {"greedy": {"temperature": 0.0}, "t1": {"temperature": 1.0},
          "t0.7_p0.9": {"temperature": 0.7, "top_p": 0.9},
          "t0.8_k40_p0.95": {"temperature": 0.8, "top_k": 40, "top_p": 0.95}}


def full_sort(logits: np.ndarray, params, rng: np.random.Generator) -> int:
    """The sampler as it was before (commit ed03075): float64, a stable sort of the whole
    vocabulary, then top-k, top-p and ``Generator.choice``."""
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < x.size:
        cut = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x >= cut, x, -np.inf)
    order = np.argsort(-x, kind="stable")
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), params.top_p, side="left")) + 1
        p = p[:keep] / p[:keep].sum()
        order = order[:keep]
    return int(order[rng.choice(p.size, p=p)])


def engine_logits(engine, rows: int = 64) -> list[np.ndarray]:
    """The logits rows of a chat prompt's first ``rows`` generated tokens."""
    from autoglm_trt.runtime import SamplingParams

    seen: list[np.ndarray] = []
    step = engine.backend.step

    def keep(feeds, slots):
        out = step(feeds, slots)
        seen.append(out[0].copy())
        return out

    engine.backend.step = keep
    try:
        engine.generate([[{"role": "user", "content": "Plan a three-day trip to Kyoto."}]],
                        SamplingParams(max_new_tokens=rows, ignore_eos=True))
    finally:
        engine.backend.step = step
    return seen[:rows]


def per_token_us(fn, rows: list[np.ndarray], params) -> float:
    rng = np.random.default_rng(0)
    times = []
    for row in rows:
        t = time.perf_counter()
        fn(row, params, rng)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def aggregate(engine, temperature: float) -> float:
    from autoglm_trt.runtime import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 48).tolist() for _ in range(16)]
    t = time.perf_counter()
    res = engine.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=temperature, seed=1))
    return sum(len(r.token_ids) for r in res) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from autoglm_trt.fileutil import cpu_model
    from autoglm_trt.runtime import Engine, SamplingParams
    from autoglm_trt.runtime import engine as engine_module
    from autoglm_trt.runtime.sampling import sample

    from .bench_runtime import ensure_engine

    if not args.engine.is_dir() and args.engine != DEFAULT_ENGINE:
        sys.exit(f"no engine at {args.engine}: build one with `autoglm-trt build`, or leave --engine out")
    path = args.engine if args.engine.is_dir() else ensure_engine("int8")
    engine = Engine.load(path)
    rows = engine_logits(engine)
    print(f"CPU: {cpu_model()}; {path.name}; {len(rows)} rows of {rows[0].size} logits")
    timing: dict[str, list[tuple[float, float]]] = {k: [] for k in PARAMS}
    rates: dict[str, list[float]] = {"new": [], "full_sort": [], "greedy": []}
    aggregate(engine, 1.0)  # warm-up
    for r in range(args.rounds):
        for name, kw in PARAMS.items():
            params = SamplingParams(**kw)
            timing[name].append((per_token_us(sample, rows, params), per_token_us(full_sort, rows, params)))
        for name in (("new", "full_sort", "greedy") if r % 2 == 0 else ("greedy", "full_sort", "new")):
            engine_module.sample = full_sort if name == "full_sort" else sample
            rates[name].append(aggregate(engine, 0.0 if name == "greedy" else 1.0))
        engine_module.sample = sample
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()),
              flush=True)
    engine.close()
    for name, pairs in timing.items():
        new, old = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        print(f"sample {name:16s} {new:9.1f} us/token, full sort {old:9.1f} us/token ({old / new:.1f}x)")
    med = {k: statistics.median(v) for k, v in rates.items()}
    speed = statistics.median(n / o for n, o in zip(rates["new"], rates["full_sort"]))
    share = statistics.median(n / g for n, g in zip(rates["new"], rates["greedy"]))
    print(f"16 concurrent, temperature 1: {med['new']:.1f} tok/s, with the full sort {med['full_sort']:.1f} "
          f"({speed:.2f}x); greedy {med['greedy']:.1f} (temperature 1 at {share:.2f}x of greedy)")


if __name__ == "__main__":
    main()
