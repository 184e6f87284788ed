#!/usr/bin/env python3
"""Calibration cost against plain ONNX Runtime forward passes over the same batches.

    python -m benchmarks.bench_calibration [--export engines/.cache/smollm2-fp32] [--samples 32,256]

For each sample count, in separate child processes (so peak RSS is each one's own), repeated
and interleaved (best time of each kind):
  forward     the float32 export run over the calibration batches, logits only (the baseline)
  calibrate   streamed statistics + threshold search (`calibrate --no-gate`; graph writing
              excluded from the ratio, reported apart)
Prints wall times, the ratio (statistics + search) / forward, and peak RSS over the model's
own size; then where the statistics pass of the first sample count spends its time, in all and
batch by batch (the first batch, the median of the later ones). Numbers go
to docs/benchmarks.md. ``--profile N``: only that split, for N samples (cProfile of
``calib.collect.collect``; ``AUTOGLM_TRT_NATIVE=0`` for the numpy path).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from .common import ROOT


def child_forward(export: Path, samples: int, seq_len: int, batch: int) -> dict:
    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.backends.onnxrt.offline import prefill_feeds
    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.model.text import token_windows

    spec = ExportRecord.read(export).spec
    windows = token_windows(ROOT / "autoglm_trt" / "calib" / "data", export, samples, seq_len, spec.eos_token_ids[0]).windows
    session = make_session(export / "model.onnx")
    each = []
    for b in range(0, len(windows), batch):
        t = time.perf_counter()
        session.run(["logits"], prefill_feeds(spec, windows[b : b + batch], "float32"))
        each.append(time.perf_counter() - t)
    return {"forward_s": sum(each), "batch_s": each}


def child_calibrate(export: Path, samples: int, seq_len: int, batch: int, out: Path) -> dict:
    from autoglm_trt.calib.pipeline import CalibConfig, calibrate

    t = time.perf_counter()
    rec = calibrate(CalibConfig(export, ROOT / "autoglm_trt" / "calib" / "data", out, num_samples=samples, seq_len=seq_len,
                                batch_size=batch, gate=False, force=True), log=lambda m: None)
    return {"collect_s": rec["timings"]["collect_s"], "search_s": rec["timings"]["search_s"],
            "total_s": time.perf_counter() - t}


def profile(export: Path, samples: int, seq_len: int, batch: int) -> None:
    import cProfile
    import pstats

    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.backends.onnxrt.offline import BoundSession
    from autoglm_trt.calib import collect
    from autoglm_trt.calib.pipeline import CalibConfig
    from autoglm_trt.calib.statistics import quantizable_inputs, rotation_blocks
    from autoglm_trt.graph.names import KINDS
    from autoglm_trt.model.text import token_windows

    spec = ExportRecord.read(export).spec
    windows = token_windows(ROOT / "autoglm_trt" / "calib" / "data", export, samples, seq_len, spec.eos_token_ids[0]).windows
    inputs = quantizable_inputs(export, True, [])
    rotate = rotation_blocks(spec, list(inputs), list(KINDS), 128)
    session = collect.calibration_session(export, list(inputs.values()))
    prof = cProfile.Profile()
    stride = CalibConfig.__dataclass_fields__["hist_row_stride"].default  # as calibrate() runs it
    plan = collect.CalibPlan(inputs, rotate, row_stride=stride, batch_size=batch)
    runs, adds = _timed(BoundSession, "run"), _timed(collect.Accumulator, "add")
    prof.runcall(collect.collect, session, spec, windows, plan, None, False)
    stats = pstats.Stats(prof)
    total = max(v[3] for v in stats.stats.values())  # type: ignore[attr-defined]
    parts = {"onnxruntime_run": ("", "run_with_iobinding"), "first_batch": ("collect.py", "_first_batch"),
             # the native library's rows, rotations and bins, on a thread pool (``calib/native_stats.py``) ...
             "native_statistics": ("native_stats.py", "add"),
             # ... or, where it cannot be built (AUTOGLM_TRT_NATIVE=0), numpy's
             "numpy_histograms": ("histogram.py", "add"), "numpy_hadamard_rotations": ("hadamard.py", "rotate_rows"),
             "numpy_kv_histograms": ("collect.py", "kv_observe"), "numpy_row_sampling": ("collect.py", "_rows")}
    out = {"total_s": round(total, 2)}
    for label, (file, func) in parts.items():
        out[label + "_s"] = round(sum(v[3] for k, v in stats.stats.items()  # type: ignore[attr-defined]
                                      if k[2].endswith(func) and k[0].endswith(file)), 2)
    # batch by batch: the first pays for first touches and the SmoothQuant maxima and samples once
    out["bound_run_batch_s"], out["statistics_batch_s"] = first_and_later(runs), first_and_later(adds)
    print(json.dumps(out))


def first_and_later(times: list[float]) -> list[float]:
    """[the first batch's time, the median of the later batches'] (seconds)."""
    return [round(times[0], 3), round(median(times[1:]), 3) if len(times) > 1 else None]


def _timed(cls: type, method: str) -> list[float]:
    """Wrap ``cls.method`` (in this profiling process only) to append each call's wall time to the list returned."""
    times: list[float] = []
    inner = getattr(cls, method)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t)

    setattr(cls, method, timed)
    return times


def run_child(*args: str) -> dict:
    """One measurement in a fresh process; its peak RSS is its own (read by the child itself)."""
    out = subprocess.run([sys.executable, "-m", __spec__.name, "--child", *args], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, default=ROOT / "engines" / ".cache" / "smollm2-fp32")
    ap.add_argument("--samples", default="32,256")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", type=int, default=None, metavar="N")
    ap.add_argument("--child", nargs="*")
    args = ap.parse_args()
    if args.profile:
        profile(args.export, args.profile, args.seq_len, args.batch)
        return
    if args.child:
        kind, export, samples = args.child[0], Path(args.child[1]), int(args.child[2])
        if kind == "forward":
            res = child_forward(export, samples, args.seq_len, args.batch)
        else:
            res = child_calibrate(export, samples, args.seq_len, args.batch, Path(args.child[3]))
        res["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        print(json.dumps(res))
        return
    if not (args.export / "model.onnx").is_file():
        subprocess.run([sys.executable, "-m", "autoglm_trt", "export", str(ROOT / "models" / "smollm2-135m"), "-o",
                        str(args.export)], check=True)
    model_gb = (args.export / "model.onnx.data").stat().st_size / 1e9
    rows = []
    for n in (int(x) for x in args.samples.split(",")):
        # interleaved repeats, best of each: these shared machines drift by 10-20% between runs
        fwds, cals = [], []
        for _ in range(args.repeats):
            fwds.append(run_child("forward", str(args.export), str(n)))
            cals.append(run_child("calibrate", str(args.export), str(n), str(args.export.parent / f"bench-int8-{n}")))
        fwd = min(fwds, key=lambda r: r["forward_s"])
        cal = min(cals, key=lambda r: r["collect_s"] + r["search_s"])
        ratio = (cal["collect_s"] + cal["search_s"]) / fwd["forward_s"]
        rows.append({"samples": n, "tokens": n * args.seq_len, "forward_s": round(fwd["forward_s"], 2),
                     "forward_batch_s": first_and_later(fwd["batch_s"]),
                     "statistics_s": round(cal["collect_s"], 2), "search_s": round(cal["search_s"], 3),
                     "ratio": round(ratio, 3), "calibrate_total_s": round(cal["total_s"], 1),
                     "peak_rss_gb": round(cal["peak_rss_gb"], 2),
                     "peak_rss_over_model_gb": round(cal["peak_rss_gb"] - model_gb, 2)})
        print(json.dumps(rows[-1]), flush=True)
    first = args.samples.split(",")[0]
    split = subprocess.run([sys.executable, "-m", __spec__.name, "--export", str(args.export), "--profile", first,
                            "--batch", str(args.batch), "--seq-len", str(args.seq_len)],
                           capture_output=True, text=True, check=True, cwd=ROOT)
    print(json.dumps({"statistics_pass_split": {"samples": int(first),
                                                **json.loads(split.stdout.strip().splitlines()[-1])}}))
    from autoglm_trt.fileutil import cpu_model

    print(f"model weights: {model_gb:.2f} GB; CPU: {cpu_model()}")


if __name__ == "__main__":
    main()
