#!/usr/bin/env python3
"""How close the demo's first answer token is: the top-2 next-token log-probabilities of the
float32 checkpoint (transformers) and of an engine, for the chat prompt ``make engine`` uses.

    python -m benchmarks.first_token_margin [--engine engines/smollm2-int8] [--prompt "..."]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .common import ROOT


def top2(logits: np.ndarray, decode) -> str:
    from autoglm_trt.graph.metrics import log_softmax

    lp = log_softmax(logits)
    a, b = np.argsort(-lp)[:2]
    return f"{decode([a])!r} {lp[a]:.3f} vs {decode([b])!r} {lp[b]:.3f}: margin {lp[a] - lp[b]:.3f} nats"


def main() -> None:
    from autoglm_trt.model.reference import hf_logits
    from autoglm_trt.model.tokenizer import TextTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "smollm2-int8")
    ap.add_argument("--prompt", default="What is the capital of France?")
    args = ap.parse_args()
    tok = TextTokenizer(args.engine)
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    ref = hf_logits(args.checkpoint)(np.asarray([ids], np.int64))[0, -1]
    print(f"float32 checkpoint: {top2(ref, tok.decode)}")
    from autoglm_trt.evaluate import model_logits

    got = model_logits(args.engine)(np.asarray([ids], np.int64))[0, -1]
    print(f"engine {args.engine.name}: {top2(got, tok.decode)}")


if __name__ == "__main__":
    main()
