#!/usr/bin/env python3
"""Calibrate a GLM-4-9B-shaped model layer by layer in bounded memory: seconds and peak RSS.

Writes the synthetic GLM-4-9B-shaped checkpoint of ``export_9b_shape.py`` (random bf16
weights, 18.8 GB; SmolLM2's tokenizer, whose ids all lie inside the 151,552-token vocabulary),
exports it to float32 ONNX (37.6 GB, the size of a real GLM-4-9B float32 export), deletes the
checkpoint, then, in a child process:

- ``--precision int8`` (the default): ``calibrate`` on 8 windows of 128 tokens of the shipped
  calibration set: statistics one decoder layer at a time (the export is far over the 1 GiB
  per statistics graph), thresholds, the INT8 graph (the 2.5 GB LM head quantized in chunks).
  The accuracy gate needs the whole float and INT8 graphs at once, so it is off (``--no-gate``).
- ``--precision int4-awq``: ``int4-awq``'s model with its default settings: the statistics pass
  one layer at a time over AWQ's 8 windows and GPTQ's 64 more, each layer's AWQ search and GPTQ
  rounding as its windows are through, then the INT4 graph: the form an ONNX Runtime build writes,
  or with ``--backend tensorrt`` a TensorRT build's (``builder.pipeline.int4_settings``).

Prints one JSON line: ``seconds`` and ``peak_rss_gb`` of the child, ``model_gb`` (the float32
export's weights), the export's own time and peak RSS, and the quantized graph's size (for
int4-awq also against the fp16 weights' size: every float32 weight at two bytes).

    python -m benchmarks.calibrate_9b_shape [--precision int8|int4-awq] [--backend onnxruntime|tensorrt]
                                           [--layers N] [--work DIR] [--keep]

Needs ~60 GB of free disk (``--layers 4``: ~15 GB) and about 20 minutes (int8); int4-awq takes about
6 minutes a layer on a 2-core machine (``--layers 4``: about 30 minutes). Not a CI test.
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
from .export_9b_shape import CONFIG, tensor_shapes, write_checkpoint

TOKENIZER = ROOT / "models" / "smollm2-135m"


def child_calibrate(export: Path, out: Path) -> None:
    from autoglm_trt.calib.pipeline import DEFAULT_DATA, CalibConfig, calibrate

    t = time.perf_counter()
    rec = calibrate(CalibConfig(export, DEFAULT_DATA, out, num_samples=8, seq_len=128, batch_size=8, gate=False,
                                force=True), log=_log)
    print(json.dumps({"seconds": round(time.perf_counter() - t, 1), "timings": rec["timings"],
                      "peak_rss_gb": _peak_rss_gb(), "int8_linears": len(rec["amax"])}))


def child_int4(export: Path, out: Path, backend: str) -> None:
    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.backends import registry
    from autoglm_trt.builder.int4_awq import int4_export
    from autoglm_trt.builder.pipeline import BuildRequest, int4_settings
    from autoglm_trt.calib.pipeline import DEFAULT_DATA

    # what `build --precision int4-awq --backend BACKEND` would quantize with
    settings = int4_settings(BuildRequest(export, out, "int4-awq"), registry.backend(backend),
                             ExportRecord.read(export).spec)
    t = time.perf_counter()
    int4_export(export, out, DEFAULT_DATA, settings, log=_log)
    rec = json.loads((out / "export.json").read_text())["int4"]
    print(json.dumps({"seconds": round(time.perf_counter() - t, 1), "peak_rss_gb": _peak_rss_gb(),
                      "linears": rec["linears"], "rounding": rec["rounding"], "block": settings.block,
                      "symmetric": settings.symmetric, "graph_dtype": settings.dtype}))


def all_layers(export: Path, out: Path, layers: int) -> dict:
    """For a shape cut to ``layers`` layers: its graphs' tensor bytes per layer and outside the
    layers (embedding, LM head, norms, rope tables), and from them the sizes of the 40-layer shape."""
    import onnx

    def split(graph: Path) -> tuple[float, float]:
        per_layer = shared = 0
        for t in onnx.load(str(graph), load_external_data=False).graph.initializer:
            length = next((int(e.value) for e in t.external_data if e.key == "length"), len(t.raw_data))
            if t.name.startswith("layers."):
                per_layer += length
            else:
                shared += length
        return per_layer / layers / 1e9, shared / 1e9

    n = CONFIG["num_hidden_layers"]
    (f_layer, f_shared), (q_layer, q_shared) = split(export / "model.onnx"), split(out / "model.int4.onnx")
    fp16 = (f_shared + n * f_layer) / 2
    int4 = q_shared + n * q_layer
    return {"int4_gb_per_layer": round(q_layer, 4), "int4_gb_outside_layers": round(q_shared, 3),
            f"computed_{n}_layers": {"int4_graph_gb": round(int4, 2), "fp16_gb": round(fp16, 2),
                                     "int4_vs_fp16": round(int4 / fp16, 3)}}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _peak_rss_gb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)


def _data_gb(directory: Path) -> float:
    return sum(f.stat().st_size for f in directory.glob("*.onnx*")) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/glm9b-calib"))
    ap.add_argument("--precision", choices=("int8", "int4-awq"), default="int8",
                    help="int8: calibrate and write the INT8 graph; int4-awq: AWQ and the INT4 graph")
    ap.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"],
                    help="decoder layers of the shape (fewer: the same widths, a shorter run; the sizes of all 40 "
                         "are then computed from the measured layers)")
    ap.add_argument("--backend", choices=("onnxruntime", "tensorrt"), default="onnxruntime",
                    help="int4-awq: the form written for this backend's build (tensorrt: float16, symmetric, its blocks)")
    ap.add_argument("--keep", action="store_true", help="keep the export and the quantized graph afterwards")
    ap.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.precision == "int4-awq":
            child_int4(*args.child, args.backend)
        else:
            child_calibrate(*args.child)
        return
    if not (TOKENIZER / "tokenizer.json").is_file():
        sys.exit(f"{TOKENIZER} is missing: run tools/prepare_smollm2.py (or make test) first")
    ckpt, export, out = args.work / "checkpoint", args.work / "export", args.work / args.precision
    if not (export / "export.json").is_file():
        print(f"writing synthetic GLM-4-9B-shaped checkpoint to {ckpt}", flush=True)
        config = {**CONFIG, "num_hidden_layers": args.layers}
        write_checkpoint(ckpt, config, tensor_shapes(config))
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
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--precision", args.precision, "--backend", args.backend,
                           "--child", str(export), str(out)], cwd=ROOT, capture_output=False, stdout=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"{args.precision} failed")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    model_gb = _data_gb(export)
    fp16_gb = model_gb / 2  # every float32 weight at two bytes
    common = {"seconds": result["seconds"], "peak_rss_gb": result["peak_rss_gb"], "model_gb": round(model_gb, 2),
              "export_seconds": export_s, "export_peak_rss_gb": export_rss}
    if args.precision == "int4-awq":
        int4_gb = _data_gb(out)
        row = {**common, "layers": args.layers, "int4_graph_gb": round(int4_gb, 2), "fp16_gb": round(fp16_gb, 2),
               "int4_vs_fp16": round(int4_gb / fp16_gb, 3), "linears": result["linears"],
               "rounding": result["rounding"], "backend": args.backend, "block": result["block"],
               "symmetric": result["symmetric"], "graph_dtype": result["graph_dtype"]}
        if args.layers != CONFIG["num_hidden_layers"]:
            row.update(all_layers(export, out, args.layers))
        print(json.dumps(row))
    else:
        print(json.dumps({**common, "int8_graph_gb": round(_data_gb(out), 2), "int8_linears": result["int8_linears"],
                          "statistics_s": result["timings"]["collect_s"],
                          "layer_by_layer": result["timings"]["layer_by_layer"]}))
    if not args.keep:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
