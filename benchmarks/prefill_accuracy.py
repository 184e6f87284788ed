#!/usr/bin/env python3
"""What the bfloat16 prefill attention costs in accuracy: the int8 engine's perplexity ratio and
top-1 agreement against the float32 checkpoint on each kind's held-out text, its windows prefilled
whole, with ``PrefillAttentionBf16`` on AMX and again with ``AUTOGLM_TRT_AMX=0`` (the same graph,
float32 attention), in one run.

    python -m benchmarks.prefill_accuracy [--tokens 1024] [--engine engines/smollm2-int8-4k]

Each setting runs in a process of its own (the AMX switch is read once a process); the engine is
``bench_prefill``'s (built if missing). Windows of ``--tokens`` tokens make the attention long
enough to matter. Where this CPU has no AMX-BF16 both rows are the float32 attention (the first
line says so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .accuracy_kinds import EVAL
from .common import ROOT, machine

SCORE = """
import json, sys
from pathlib import Path
from autoglm_trt.evaluate import evaluate
engine, text, checkpoint, tokens = sys.argv[1:5]
r = evaluate(Path(engine), Path(text), Path(checkpoint), seq_len=int(tokens))
print(json.dumps({"ppl_ratio": round(r["ppl_ratio"], 4), "top1": round(r["top1_agreement"], 4), "tokens": r["tokens"]}))
"""


def score(engine: Path, kind_file: Path, tokens: int, amx: bool) -> dict:
    env = dict(os.environ, AUTOGLM_TRT_AMX="1" if amx else "0")
    done = subprocess.run([sys.executable, "-c", SCORE, str(engine), str(kind_file), str(ROOT / "models" / "smollm2-135m"),
                           str(tokens)], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from autoglm_trt.native import attention_bf16, library

    from .bench_prefill import ensure

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--engine", type=Path, default=None)
    args = ap.parse_args()
    engine = args.engine or ensure("int8")
    path, why = library()
    bf16 = path is not None and attention_bf16(path)
    print(f"{machine()}; bfloat16 attention here: {'yes' if bf16 else 'no (' + (why or 'no AMX-BF16') + ')'}", flush=True)
    rows = {}
    for label, amx in (("bfloat16 attention (AMX)", True), ("float32 attention (AUTOGLM_TRT_AMX=0)", False)):
        rows[label] = {kind: score(engine, ROOT / "calibration" / "eval" / name, args.tokens, amx)
                       for kind, name in EVAL.items()}
        print(json.dumps({"setting": label, "windows_of": args.tokens, **rows[label]}), flush=True)
    print("| int8 engine | " + " | ".join(EVAL) + " |")
    print("|---|" + "---|" * len(EVAL))
    for label, kinds in rows.items():
        print(f"| {label} | " + " | ".join(f"{k['ppl_ratio']:.4f} / {k['top1']:.3f}" for k in kinds.values()) + " |")


if __name__ == "__main__":
    main()
