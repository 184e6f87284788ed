#!/usr/bin/env python3
"""The README's accuracy table: each INT8 variant calibrated from the SmolLM2 export and scored
on the held-out text against the float32 checkpoint (and the FP16 export as a row of its own).

    python -m benchmarks.accuracy_table [--variants default,down-head,no-rotation,...] [--json out.json]

Each row: the calibration's own gate result on the calibration windows (ppl ratio / top-1, and
how many linears it kept in float) and ``eval`` on ``calibration/eval/heldout.txt`` (ppl
ratio, top-1 agreement, mean KL). One calibration per row, so rows move by about +-0.003 in
ppl ratio between numerically equivalent runs (README, "Calibration and accuracy").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import ROOT

VARIANTS = {
    "default": {},
    "down-head": {"rotate": ["down", "lm_head"]},
    "down-head-all-int8": {"rotate": ["down", "lm_head"], "gate": False},
    "down-float-head-all-int8": {"rotate": ["down"], "quantize_lm_head": False, "gate": False},
    "no-rotation": {"rotate": []},
    "no-rotation-all-int8": {"rotate": [], "gate": False},
}


def main() -> None:
    from autoglm_trt.calib.pipeline import DEFAULT_DATA, CalibConfig, calibrate
    from autoglm_trt.evaluate import evaluate
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint
    from autoglm_trt.fileutil import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--work", type=Path, default=ROOT / "engines" / ".cache" / "accuracy")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--fp16", action="store_true", help="also score the FP16 export")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    text = ROOT / "calibration" / "eval" / "heldout.txt"
    quiet = lambda m: None  # noqa: E731
    export = args.work / "export-fp32"
    if not (export / "export.json").is_file():
        export_checkpoint(ExportConfig(args.checkpoint, export, validate=False, force=True), log=quiet)
    rows = []
    if args.fp16:
        fp16 = args.work / "export-fp16"
        if not (fp16 / "export.json").is_file():
            export_checkpoint(ExportConfig(args.checkpoint, fp16, dtype="float16", validate=False, force=True),
                              log=quiet)
        res = evaluate(fp16, text, args.checkpoint)
        rows.append({"variant": "fp16-export", **{k: res[k] for k in ("ppl_ratio", "top1_agreement", "kl")}})
        print(json.dumps(rows[-1]), flush=True)
    for name in args.variants.split(","):
        out = args.work / f"int8-{name}"
        record = calibrate(CalibConfig(export, DEFAULT_DATA, out, replace_mismatch=True, **VARIANTS[name]), log=quiet)
        res = evaluate(out, text, args.checkpoint)
        gate = record["gate"].get("result", {})
        rows.append({"variant": name, "settings": VARIANTS[name], "int8_linears": len(record["amax"]),
                     "float_linears": len(record["float_linears"]),
                     "gate_ppl_ratio": gate.get("ppl_ratio"), "gate_top1": gate.get("top1_agreement"),
                     "ppl_ratio": res["ppl_ratio"], "top1_agreement": res["top1_agreement"], "kl": res["kl"],
                     "heldout_tokens": res["tokens"]})
        print(json.dumps(rows[-1]), flush=True)
    print(f"CPU: {cpu_model()}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
