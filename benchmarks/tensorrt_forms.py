#!/usr/bin/env python3
"""How the float16 graphs a TensorRT build compiles answer, against the float32 graphs of the same plans.

    python -m benchmarks.tensorrt_forms [--windows 16] [--json out.json]

SmolLM2-135M's int8 (calibrated, the gate on), int8-wo and int4-awq in TensorRT's forms (8-bit
weight-only weights one scale per output channel, as its Dequantize takes no INT8 blocks; symmetric
INT4 in blocks of 64, the largest block it takes that divides SmolLM2's 576-wide inputs), each
written twice from one plan: in float32, as ONNX Runtime's engine starts from, and in float16, as
a TensorRT build writes it (``write_int8_graph``'s ``dtype``). Each graph runs unoptimized on ONNX
Runtime's CPU (its optimizer would fuse the DequantizeLinear and MatMul into its own quantized
kernels): float16 operands of each GEMM, float32 sums, float16 results. Scored on each kind's
first ``--windows`` windows of 256 held-out tokens against the float32 checkpoint in transformers:
perplexity ratio and top-1 agreement, and the share of positions where the two forms of a plan
predict the same token. No TensorRT runs here; its kernels round in their own order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from .accuracy_kinds import EVAL
from .common import ROOT, machine

DATA = ROOT / "autoglm_trt" / "calib" / "data"
KINDS = {k: v for k, v in EVAL.items() if k != "dialogue"}  # dialogue's held-out text is 6 windows long


def plans(export: Path, work: Path) -> dict[str, dict[str, Path]]:
    """precision -> form -> the model directory of that plan in that form (made or reused)."""
    from autoglm_trt.builder.int4_awq import Int4Settings, int4_export
    from autoglm_trt.builder.weight_only import weight_only_export
    from autoglm_trt.calib.pipeline import CalibConfig, calibrate

    quiet = lambda m: None  # noqa: E731
    out: dict[str, dict[str, Path]] = {"int8": {}, "int8-wo": {}, "int4-awq": {}}
    for dtype in ("float32", "float16"):
        calibrate(CalibConfig(export, DATA, work / f"int8-{dtype}", replace_mismatch=True, graph_dtype=dtype), log=quiet)
        out["int8"][dtype] = work / f"int8-{dtype}"
        out["int8-wo"][dtype] = weight_only_export(export, work / f"int8wo-{dtype}", quiet, int8_embedding=False,
                                                   dtype=dtype, int8_channels=True)
        out["int4-awq"][dtype] = int4_export(export, work / f"int4-{dtype}", DATA,
                                             Int4Settings(block=64, symmetric=True, int8_embedding=False, dtype=dtype,
                                                          int8_channels=True),
                                             log=quiet)
    return out


def scores(model_dir: Path | None, checkpoint: Path, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each next token's negative log-likelihood and the predicted token ``[windows, 255]``: of the
    model directory's graph run unoptimized, or (None) of the checkpoint in transformers."""
    from autoglm_trt.backends.onnxrt.offline import GraphRunner
    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.graph.metrics import next_token_scores
    from autoglm_trt.model.reference import hf_logits

    if model_dir is None:
        run = hf_logits(checkpoint)
    else:
        runner = GraphRunner(model_dir)
        runner.session = make_session(runner.record.graph_file, optimize=False)
        run = runner.logits
    nll, top = [], []
    for start in range(0, len(windows), 4):
        w = windows[start : start + 4]
        lp, n = next_token_scores(run(w), w)
        nll.append(n)
        top.append(lp.argmax(-1))
    return np.concatenate(nll), np.concatenate(top)


def main() -> None:
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint
    from autoglm_trt.model.text import text_chunks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--work", type=Path, default=ROOT / "engines" / ".cache" / "tensorrt-forms")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    export = args.work / "export-fp32"
    if not (export / "export.json").is_file():
        export_checkpoint(ExportConfig(args.checkpoint, export, validate=False, force=True), log=lambda m: None)
    models = plans(export, args.work)
    print(machine())
    rows = []
    for kind, name in KINDS.items():
        windows = text_chunks(ROOT / "calibration" / "eval" / name, export, 256, args.windows)
        ref_nll, ref_top = scores(None, args.checkpoint, windows)
        for precision, forms in models.items():
            got = {dtype: scores(d, args.checkpoint, windows) for dtype, d in forms.items()}
            row = {"kind": kind, "precision": precision, "tokens": int(ref_nll.size),
                   **{dtype: {"ppl_ratio": round(float(np.exp(nll.mean() - ref_nll.mean())), 4),
                              "top1": round(float((top == ref_top).mean()), 4)} for dtype, (nll, top) in got.items()},
                   "forms_agree": round(float((got["float16"][1] == got["float32"][1]).mean()), 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| precision | kind | float32 graph: ppl ratio / top-1 | float16 graph (TensorRT's) | same token |")
    print("|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: list(models).index(r["precision"])):
        print(f"| {r['precision']} | {r['kind']} | {r['float32']['ppl_ratio']:.4f} / {r['float32']['top1']:.4f} | "
              f"{r['float16']['ppl_ratio']:.4f} / {r['float16']['top1']:.4f} | {r['forms_agree']:.4f} |")
    print(machine())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
