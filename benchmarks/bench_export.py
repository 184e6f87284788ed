#!/usr/bin/env python3
"""Wall time and peak RSS of exporting SmolLM2, without and with the transformers parity check,
each in a fresh process (its own peak RSS).

    python -m benchmarks.bench_export [--checkpoint models/smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import ROOT


def child(checkpoint: Path, out: Path, validate: bool) -> None:
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint

    t = time.perf_counter()
    export_checkpoint(ExportConfig(checkpoint, out, validate=validate, force=True), log=lambda m: None)
    print(json.dumps({"validate": validate, "wall_s": round(time.perf_counter() - t, 2),
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        child(args.checkpoint, Path(args.child[0]), args.child[1] == "1")
        return
    from autoglm_trt.fileutil import cpu_model

    with tempfile.TemporaryDirectory() as tmp:
        for validate in ("0", "1"):
            out = subprocess.run([sys.executable, "-m", __spec__.name, "--checkpoint", str(args.checkpoint), "--child",
                                  str(Path(tmp) / "export"), validate], capture_output=True, text=True, check=True,
                                 cwd=ROOT)
            print(out.stdout.strip().splitlines()[-1], flush=True)
    print(f"CPU: {cpu_model()}")


if __name__ == "__main__":
    main()
