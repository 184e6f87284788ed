#!/usr/bin/env python3
"""Task-level INT8 check: greedy answers of the INT8 and the float32 engine to 100 varied chat
prompts (``calibration/eval/prompts.txt``: knowledge, how-to, arithmetic, writing, code,
phone-agent tasks, translation, Chinese, advice, recommendations), compared token by token.

    python -m benchmarks.chat_agreement [--int8 engines/smollm2-int8] [--fp32 engines/smollm2-fp32] [--tokens 16]

Prints the share of prompts whose first ``--tokens`` answer tokens are identical (an answer that
ends sooner counts when both end at the same token), the share with the same first token, the
median position of the first difference among those that differ, and where the ``make engine``
demo prompt falls. Both engines run all prompts at once (continuous batching).
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
    from autoglm_trt.runtime import Engine, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--int8", type=Path, default=ROOT / "engines" / "smollm2-int8")
    ap.add_argument("--fp32", type=Path, default=ROOT / "engines" / "smollm2-fp32")
    ap.add_argument("--prompts", type=Path, default=ROOT / "calibration" / "eval" / "prompts.txt")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--show", type=int, default=3, help="print this many differing answers")
    args = ap.parse_args()
    prompts = [p for p in args.prompts.read_text(encoding="utf-8").splitlines() if p.strip()]
    chats = [[{"role": "user", "content": p}] for p in prompts + [DEMO]]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0)
    answers = {}
    for name, path in (("int8", args.int8), ("fp32", args.fp32)):
        engine = Engine.load(path)
        try:
            answers[name] = engine.generate(chats, params)
        finally:
            engine.close()
    diffs = [first_difference(a.token_ids, b.token_ids) for a, b in zip(answers["int8"], answers["fp32"])]
    tested, demo = diffs[:-1], diffs[-1]
    differing = sorted(d for d in tested if d is not None)
    result = {
        "prompts": len(tested), "tokens": args.tokens,
        "same_first_tokens": sum(d is None for d in tested) / len(tested),
        "same_first_token": sum(d is None or d > 0 for d in tested) / len(tested),
        "median_first_difference": differing[len(differing) // 2] if differing else None,
        "demo_prompt_identical": demo is None,
        "cpu": cpu_model(),
    }
    print(json.dumps(result))
    shown = 0
    for p, d, a, b in zip(prompts, tested, answers["int8"], answers["fp32"]):
        if d is not None and shown < args.show:
            print(f"- {p!r} differs at token {d}:\n    int8: {a.text!r}\n    fp32: {b.text!r}")
            shown += 1


if __name__ == "__main__":
    main()
