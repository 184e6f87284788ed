#!/usr/bin/env python3
"""Calibrate a GLM-4-9B-shaped model layer by layer in bounded memory: seconds and peak RSS.

Writes the synthetic GLM-4-9B-shaped checkpoint of ``export_9b_shape.py`` (random bf16
weights, 18.8 GB; SmolLM2's tokenizer, whose ids all lie inside the 151,552-token vocabulary),
exports it to float32 ONNX (37.6 GB, the size of a real GLM-4-9B float32 export), deletes the
checkpoint, then runs ``calibrate`` on 8 windows of 128 tokens of the shipped calibration set
in a child process: statistics one decoder layer at a time (the export is far over the 1 GiB
per statistics graph), thresholds, the INT8 graph (the 2.5 GB LM head quantized in chunks).
The accuracy gate needs the whole float and INT8 graphs at once, so it is off (``--no-gate``).
Prints one JSON line: ``seconds`` and ``peak_rss_gb`` of the calibration, ``model_gb`` (the
float32 export's weights), the export's own time and peak RSS, and the INT8 graph's size.

    python -m benchmarks.calibrate_9b_shape [--work /tmp/glm9b-calib] [--keep]

Needs ~60 GB of free disk and about 20 minutes. Not a CI test.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import ROOT
from .export_9b_shape import write_checkpoint

TOKENIZER = ROOT / "models" / "smollm2-135m"


def child_calibrate(export: Path, out: Path) -> None:
    from autoglm_trt.calib.pipeline import DEFAULT_DATA, CalibConfig, calibrate

    t = time.perf_counter()
    rec = calibrate(CalibConfig(export, DEFAULT_DATA, out, num_samples=8, seq_len=128, batch_size=8, gate=False,
                                force=True), log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({"seconds": round(time.perf_counter() - t, 1), "timings": rec["timings"],
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2),
                      "int8_linears": len(rec["amax"])}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/glm9b-calib"))
    ap.add_argument("--keep", action="store_true", help="keep the export and the INT8 graph afterwards")
    ap.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_calibrate(*args.child)
        return
    if not (TOKENIZER / "tokenizer.json").is_file():
        sys.exit(f"{TOKENIZER} is missing: run tools/prepare_smollm2.py (or make test) first")
    ckpt, export, out = args.work / "checkpoint", args.work / "export", args.work / "int8"
    if not (export / "export.json").is_file():
        print(f"writing synthetic GLM-4-9B-shaped checkpoint to {ckpt}", flush=True)
        write_checkpoint(ckpt)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / name, ckpt / name)
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "autoglm_trt", "export", str(ckpt), "-o", str(export), "--dtype", "float32",
               "--no-validate", "--force"]
        if subprocess.run(cmd).returncode != 0:
            sys.exit("export failed")
        export_s = round(time.perf_counter() - t, 1)
        export_rss = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9, 2)
        shutil.rmtree(ckpt)  # room on disk for the INT8 graph
    else:
        export_s = export_rss = None  # reused from an earlier --keep run
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--child", str(export), str(out)], cwd=ROOT,
                          capture_output=False, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit("calibration failed")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    model_gb = (export / "model.onnx.data").stat().st_size / 1e9
    int8_gb = (out / "model.int8.onnx.data").stat().st_size / 1e9
    print(json.dumps({"seconds": result["seconds"], "peak_rss_gb": result["peak_rss_gb"],
                      "model_gb": round(model_gb, 2), "int8_graph_gb": round(int8_gb, 2),
                      "int8_linears": result["int8_linears"], "statistics_s": result["timings"]["collect_s"],
                      "layer_by_layer": result["timings"]["layer_by_layer"], "export_seconds": export_s,
                      "export_peak_rss_gb": export_rss}))
    if not args.keep:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
