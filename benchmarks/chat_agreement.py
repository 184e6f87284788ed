#!/usr/bin/env python3
"""Task-level quantization check: greedy answers of each quantized engine and of the float32
engine to 100 varied chat prompts (``calibration/eval/prompts.txt``: knowledge, how-to,
arithmetic, writing, code, phone-agent tasks, translation, Chinese, advice, recommendations),
compared token by token.

    python -m benchmarks.chat_agreement [--engine int8=engines/smollm2-int8 ...] [--fp32 engines/smollm2-fp32]
                                        [--tokens 16]

For each ``--engine NAME=DIR`` (default: the INT8 engine) prints one JSON line: the share of
prompts whose first ``--tokens`` answer tokens are identical to fp32's (an answer that ends
sooner counts when both end at the same token), the share with the same first token, the median
position of the first difference among those that differ, and where the ``make engine`` demo
prompt falls. Each engine runs all prompts at once (continuous batching). ``answers`` (importable)
gives the token ids for other runtimes' comparisons.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import ROOT

DEMO = "What is the capital of France?"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when the two are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    from autoglm_trt.fileutil import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="append", default=[], metavar="NAME=DIR",
                    help="an engine to compare with fp32 (repeatable) [default: int8=engines/smollm2-int8]")
    ap.add_argument("--fp32", type=Path, default=ROOT / "engines" / "smollm2-fp32")
    ap.add_argument("--prompts", type=Path, default=ROOT / "calibration" / "eval" / "prompts.txt")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--show", type=int, default=3, help="print this many differing answers")
    args = ap.parse_args()
    prompts = read_prompts(args.prompts)
    engines = dict(item.split("=", 1) for item in args.engine) or {"int8": str(ROOT / "engines" / "smollm2-int8")}
    reference = answers(Path(args.fp32), prompts, args.tokens)
    for name, path in engines.items():
        got = answers(Path(path), prompts, args.tokens)
        print(json.dumps({"engine": name, **agreement([a.token_ids for a in got], [b.token_ids for b in reference],
                                                        args.tokens), "cpu": cpu_model()}), flush=True)
        shown = 0
        for p, a, b in zip(prompts, got, reference):
            d = first_difference(a.token_ids, b.token_ids)
            if d is not None and shown < args.show:
                print(f"- {p!r} differs at token {d}:\n    {name}: {a.text!r}\n    fp32: {b.text!r}")
                shown += 1


def read_prompts(path: Path) -> list[str]:
    """The tested prompts, then the demo prompt last."""
    return [p for p in path.read_text(encoding="utf-8").splitlines() if p.strip()] + [DEMO]


def answers(engine_dir: Path, prompts: list[str], tokens: int) -> list:
    """Each prompt's greedy answer (``GenerationResult``) of the engine, as one user turn."""
    from autoglm_trt.runtime import Engine, SamplingParams

    engine = Engine.load(engine_dir)
    try:
        return engine.generate([[{"role": "user", "content": p}] for p in prompts],
                               SamplingParams(max_new_tokens=tokens, temperature=0.0))
    finally:
        engine.close()


def agreement(got: list[list[int]], reference: list[list[int]], tokens: int) -> dict:
    """How ``got``'s answers agree with ``reference``'s (the last of each: the demo prompt)."""
    diffs = [first_difference(a, b) for a, b in zip(got, reference)]
    tested, demo = diffs[:-1], diffs[-1]
    differing = sorted(d for d in tested if d is not None)
    return {
        "prompts": len(tested), "tokens": tokens,
        "same_first_tokens": sum(d is None for d in tested) / len(tested),
        "same_first_token": sum(d is None or d > 0 for d in tested) / len(tested),
        "median_first_difference": differing[len(differing) // 2] if differing else None,
        "demo_prompt_identical": demo is None,
    }


if __name__ == "__main__":
    main()
