#!/usr/bin/env python3
"""INT8 accuracy as the runtime computes it: teacher-forced decode steps through the ONNX
Runtime runner, on each kind's held-out text, against the float32 engine (a kind whose text
is shorter gives fewer windows: dialogue gives 5).

    python -m benchmarks.runtime_accuracy [--int8 engines/smollm2-int8] [--fp32 engines/smollm2-fp32]
                                       [--windows 16] [--tokens 256] [--json out.json]

``eval`` and ``accuracy_kinds.py`` score the saved engine graph. The runner loads that graph
rewritten for ONNX Runtime (native operators where the native library is installed: ``runner.py``), whose
arithmetic rounds differently in places (the attention's sums, the MLP's sigmoid), so this
script measures what a user's requests see. Each kind's first ``--windows`` windows of
``--tokens`` tokens go through the runner together: a prefill of their first 16 tokens, then
one decode step per token, each step fed the text's true next token. Every position after the
prefill is scored. Printed per kind: PPL ratio (INT8 / float32) and top-1 agreement, for the
INT8 engine with the native operators and with the graph's own nodes (``AUTOGLM_TRT_NATIVE=0``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from .common import ROOT

PREFILL = 16
KINDS = {"python-docs": "heldout.txt", "prose": "prose.txt", "code": "code.txt", "chinese": "chinese.txt",
         "dialogue": "dialogue.jsonl"}


def decode_logits(engine: Path, windows: np.ndarray, native: bool) -> np.ndarray:
    """Log-probabilities ``[windows, tokens - PREFILL, vocab]`` of each next token after the prefill."""
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends import open_runner
    from autoglm_trt.graph.metrics import log_softmax
    from autoglm_trt.kvcache.layout import blocks_needed
    from autoglm_trt.kvcache.step_inputs import SeqState, step_inputs

    os.environ["AUTOGLM_TRT_NATIVE"] = "1" if native else "0"
    manifest = Manifest.read(engine)
    n, length = windows.shape
    bs = manifest.kv.block_size
    per_seq = blocks_needed(length, bs)
    runner = open_runner(manifest, num_blocks=n * per_seq, threads=2)
    states = [SeqState(0, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(n)]
    out = []
    new = [list(map(int, w[:PREFILL])) for w in windows]
    for at in range(PREFILL, length + 1):
        feeds, slots = step_inputs(new, states, bs)
        logits = runner.step(feeds, slots)
        out.append(log_softmax(logits, np.float64))
        for s, toks in zip(states, new):
            s.num_computed_tokens += len(toks)
        if at < length:
            new = [[int(w[at])] for w in windows]
    runner.close()
    return np.stack(out[:-1], axis=1)  # the last step predicts past the window


def main() -> None:
    from autoglm_trt.model.text import text_chunks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--int8", type=Path, default=ROOT / "engines" / "smollm2-int8")
    ap.add_argument("--fp32", type=Path, default=ROOT / "engines" / "smollm2-fp32")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    print(f"CPU: {cpu}; {args.windows} windows of {args.tokens} tokens per kind, {PREFILL}-token prefill, "
          "then one decode step per token")
    rows = {}
    for kind, name in KINDS.items():
        windows = text_chunks(ROOT / "calibration" / "eval" / name, args.int8, args.tokens, args.windows)
        targets = windows[:, PREFILL:]
        ref = decode_logits(args.fp32, windows, native=True)
        ref_nll = -np.take_along_axis(ref, targets[..., None], -1).mean()
        row = {"tokens_scored": int(targets.size), "fp32_ppl": float(np.exp(ref_nll))}
        for label, native in (("native", True), ("graph", False)):
            lp = decode_logits(args.int8, windows, native)
            nll = -np.take_along_axis(lp, targets[..., None], -1).mean()
            row[f"int8_{label}_ppl_ratio"] = float(np.exp(nll - ref_nll))
            row[f"int8_{label}_top1"] = float((lp.argmax(-1) == ref.argmax(-1)).mean())
        rows[kind] = row
        print(f"{kind:12s} {targets.size:5d} tokens, fp32 ppl {row['fp32_ppl']:8.3f} | int8 native: ratio "
              f"{row['int8_native_ppl_ratio']:.4f} top-1 {row['int8_native_top1']:.3f} | int8 graph: ratio "
              f"{row['int8_graph_ppl_ratio']:.4f} top-1 {row['int8_graph_top1']:.3f}", flush=True)
    result = {"cpu": cpu, "windows": args.windows, "tokens": args.tokens, "kinds": rows}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
