#!/usr/bin/env python3
"""What structured output and penalties cost in decode throughput, in one run on this machine.

    python -m benchmarks.bench_guided [--engine engines/smollm2-int8] [--rounds 3]

16 concurrent requests (a chat prompt, 64 new tokens, temperature 0.7, seeded) on SmolLM2-135M,
three ways in each round, alternating: free; every one under a JSON schema (an action object:
enum, bounded integers, a string); every one with Open-AutoGLM's penalty (frequency_penalty
0.2) and a repetition penalty. Prints aggregate generated tokens/s of each and the median gap
between a request's tokens (the step time with all 16 running), medians over rounds, their
ratios to free (medians of the rounds' ratios), and the CPU model. The issue's goals:
guided >= 0.85x, penalties >= 0.95x. The engine is built first if missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .common import machine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["action", "x", "y", "note"],
          "properties": {"action": {"enum": ["tap", "swipe", "type", "back"]},
                         "x": {"type": "integer", "minimum": 0, "maximum": 999},
                         "y": {"type": "integer", "minimum": 0, "maximum": 999},
                         "note": {"type": "string", "maxLength": 200}}}


def run(engine, params, prompts) -> tuple[float, float]:
    """Aggregate generated tokens/s, and the median gap between a request's tokens in ms (the decode
    step's time while the 16 run together: guided answers end sooner, so the aggregate also counts
    the emptier steps at the end)."""
    import numpy as np

    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    gaps = np.concatenate([np.diff(r.token_times) for r in results if len(r.token_times) > 1])
    return sum(len(r.token_ids) for r in results) / wall, 1000 * float(np.median(gaps))


def main() -> None:
    from autoglm_trt.runtime import Engine, Guide, SamplingParams

    from .bench_runtime import ensure_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=None, help="default: engines/smollm2-int8 (built if missing)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine_dir = args.engine or ensure_engine("int8")
    prompts = [[{"role": "user", "content": f"Screen {k}: reply with the next action as JSON."}] for k in range(16)]
    base = dict(max_new_tokens=64, temperature=0.7, seed=1)
    ways = {"free": SamplingParams(**base),
            "json_schema": SamplingParams(**base, guide=Guide.json_schema(SCHEMA)),
            "penalties": SamplingParams(**base, frequency_penalty=0.2, repetition_penalty=1.1)}
    rates: dict[str, list[float]] = {k: [] for k in ways}
    steps: dict[str, list[float]] = {k: [] for k in ways}
    with Engine.load(engine_dir) as engine:
        for params in ways.values():  # warm-up, grammar compiled
            engine.generate(prompts[:2], params)
        for _ in range(args.rounds):
            for name, params in ways.items():
                rate, step = run(engine, params, prompts)
                rates[name].append(rate)
                steps[name].append(step)
    ratio = {k: statistics.median(a / b for a, b in zip(rates[k], rates["free"])) for k in ways if k != "free"}
    step_ratio = {k: statistics.median(b / a for a, b in zip(steps[k], steps["free"])) for k in ways if k != "free"}
    print(json.dumps({"tokens_per_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
                      "ratio_to_free": {k: round(v, 3) for k, v in ratio.items()},
                      "token_gap_ms": {k: round(statistics.median(v), 2) for k, v in steps.items()},
                      "decode_rate_ratio_to_free": {k: round(v, 3) for k, v in step_ratio.items()},
                      "rounds": args.rounds, "machine": machine()}))


if __name__ == "__main__":
    main()
