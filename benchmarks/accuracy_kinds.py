#!/usr/bin/env python3
"""INT8 accuracy on each kind of text: the SmolLM2 export calibrated on one set of kinds, scored
on every kind's held-out text against the float32 checkpoint (ppl ratio, top-1 agreement).

    python -m benchmarks.accuracy_kinds [--calib-kinds all|python-docs,...] [--set KEY=JSON] [--json out.json]

Kinds (``calibration/README.md``): python-docs (``eval/heldout.txt``), prose, code, chinese,
dialogue. ``--calib-kinds`` picks which of ``autoglm_trt/calib/data``'s kinds the calibration sees
(``all``: the shipped default set); several comma-separated settings run one after another.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from .common import ROOT

EVAL = {"python-docs": "heldout.txt", "prose": "prose.txt", "code": "code.txt", "chinese": "chinese.txt",
        "dialogue": "dialogue.jsonl"}


def kind_of(data_file: Path) -> str:
    """A file of autoglm_trt/calib/data: ``<kind>.txt`` / ``<kind>.jsonl``, or a numbered Python-docs file."""
    return data_file.stem if data_file.stem in EVAL else "python-docs"


def calibration_subset(kinds: str, into: Path) -> Path:
    data = ROOT / "autoglm_trt" / "calib" / "data"
    if kinds == "all":
        return data
    wanted = set(kinds.split("+"))
    unknown = wanted - set(EVAL)
    if unknown:
        raise SystemExit(f"unknown kinds {sorted(unknown)}; choose from {list(EVAL)} joined by '+', or 'all'")
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for f in sorted(data.iterdir()):
        if kind_of(f) in wanted:
            shutil.copy2(f, into / f.name)
    return into


def main() -> None:
    from autoglm_trt.calib.pipeline import CalibConfig, calibrate
    from autoglm_trt.evaluate import evaluate
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint
    from autoglm_trt.fileutil import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--work", type=Path, default=ROOT / "engines" / ".cache" / "accuracy")
    ap.add_argument("--calib-kinds", default="all", help="'all', or kinds joined by '+'; several settings by ','")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="a CalibConfig setting for every calibration, e.g. target_ppl_ratio=1.01")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    quiet = lambda m: None  # noqa: E731
    export = args.work / "export-fp32"
    if not (export / "export.json").is_file():
        export_checkpoint(ExportConfig(args.checkpoint, export, validate=False, force=True), log=quiet)
    rows = []
    for setting in args.calib_kinds.split(","):
        tag = setting.replace("+", "-") + "".join(f"-{k}{v}" for k, v in overrides.items())
        data = calibration_subset(setting, args.work / f"data-{tag}")
        out = args.work / f"int8-kinds-{tag}"
        record = calibrate(CalibConfig(export, data, out, replace_mismatch=True, **overrides), log=quiet)
        gate = record["gate"].get("result", {})
        row = {"calibrated_on": setting, "settings": overrides, "float_linears": len(record["float_linears"]),
               "gate_ppl_ratio": gate.get("ppl_ratio"), "gate_top1": gate.get("top1_agreement"), "kinds": {}}
        for kind, name in EVAL.items():
            res = evaluate(out, ROOT / "calibration" / "eval" / name, args.checkpoint)
            row["kinds"][kind] = {"ppl_ratio": round(res["ppl_ratio"], 4), "top1": round(res["top1_agreement"], 4),
                                  "tokens": res["tokens"], "ref_ppl": round(res["ref_ppl"], 2)}
            print(json.dumps({"calibrated_on": setting, "kind": kind, **row["kinds"][kind]}), flush=True)
        rows.append(row)
    print(f"CPU: {cpu_model()}")
    print("| calibrated on | " + " | ".join(EVAL) + " |")
    print("|---|" + "---|" * len(EVAL))
    for row in rows:
        cells = [f"{row['kinds'][k]['ppl_ratio']:.4f} / {row['kinds'][k]['top1']:.3f}" for k in EVAL]
        print(f"| {row['calibrated_on']} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
