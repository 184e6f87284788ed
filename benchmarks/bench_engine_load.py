#!/usr/bin/env python3
"""A 9B-wide engine with its native operators' packed weights saved, and made when it loads.

Writes a synthetic GLM-4-9B-shaped checkpoint cut to ``--layers`` decoder layers (every width and
the vocabulary as GLM-4-9B's: its LM head alone is 0.66 GB at INT8), builds it as an ``int8-wo``
ONNX Runtime engine twice from one export, once keeping ``model.native.bin`` and once leaving the
packed weights to be made at load (``backends/onnxrt/loader.py``, what a build does by default
over ``PACK_AT_LOAD_BYTES``), and prints each engine's size on disk and time to load (the median
of ``--rounds`` loads, each in a fresh process, after one to warm the page cache), and whether the
two give the same logits.

    python -m benchmarks.bench_engine_load [--layers 2] [--rounds 3] [--work /tmp/glm9b-load] [--keep]

Needs ~20 GB of free disk and about 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import ROOT, machine
from .export_9b_shape import CONFIG, tensor_shapes, write_checkpoint

TOKENIZER = ROOT / "models" / "smollm2-135m"
PROMPT = list(range(1000, 1032))


def build(ckpt: Path, out: Path, saved: bool) -> None:
    from autoglm_trt.backends.onnxrt import loader
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine

    loader.PACK_AT_LOAD_BYTES = 1 << 62 if saved else 0
    build_engine(BuildRequest(ckpt, out, precision="int8-wo", backend="onnxruntime", force=True,
                              cache_dir=out.parent / ".cache",
                              config=BuildConfig(max_batch_size=1, max_input_len=64, max_seq_len=128,
                                                 kv_num_blocks=16, kv_block_size=16)),
                 log=lambda m: print(m, file=sys.stderr, flush=True))


def child_load(engine: Path) -> None:
    """One load of ``engine`` (the runner's session and pools), then one prefill's last logits."""
    import numpy as np

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt.backend import BACKEND as ort

    t = time.perf_counter()
    runner = ort.graph_runner(Manifest.read(engine), 0)
    seconds = time.perf_counter() - t
    logits = runner.logits(np.array([PROMPT], np.int64))[0, -1]
    print(json.dumps({"seconds": seconds, "logits": [float(v) for v in logits[:64]],
                      "argmax": int(np.argmax(logits))}))


def load(engine: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--child", str(engine)], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/glm9b-load"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and engines afterwards")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_load(args.child)
        return
    if not (TOKENIZER / "tokenizer.json").is_file():
        sys.exit(f"{TOKENIZER} is missing: run tools/prepare_smollm2.py (or make test) first")
    print(machine(), flush=True)
    ckpt = args.work / "checkpoint"
    if not (ckpt / "config.json").is_file():
        config = {**CONFIG, "num_hidden_layers": args.layers}
        write_checkpoint(ckpt, config, tensor_shapes(config))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / name, ckpt / name)
    rows = {}
    for kind, saved in (("saved", True), ("at_load", False)):
        engine = args.work / f"engine-{kind}"
        build(ckpt, engine, saved)
        load(engine)  # the page cache warmed
        runs = [load(engine) for _ in range(args.rounds)]
        graphs = json.loads((engine / "manifest.json").read_text())["onnxruntime"]
        rows[kind] = {"engine_gb": round(sum(f.stat().st_size for f in engine.iterdir()) / 1e9, 2),
                      "native_bin_gb": round((engine / "model.native.bin").stat().st_size / 1e9, 2)
                      if (engine / "model.native.bin").is_file() else 0.0,
                      "packed_at_load": graphs.get("packed_at_load") is not None,
                      "load_s": round(statistics.median(r["seconds"] for r in runs), 2),
                      "logits": runs[0]["logits"], "argmax": runs[0]["argmax"]}
    same = rows["saved"]["logits"] == rows["at_load"]["logits"] and rows["saved"]["argmax"] == rows["at_load"]["argmax"]
    for kind, row in rows.items():
        print(json.dumps({"engine": kind, "layers": args.layers,
                          **{k: v for k, v in row.items() if k not in ("logits", "argmax")}}))
    print(json.dumps({"at_load_size_vs_saved": round(rows["at_load"]["engine_gb"] / rows["saved"]["engine_gb"], 3),
                      "at_load_load_s_minus_saved": round(rows["at_load"]["load_s"] - rows["saved"]["load_s"], 2),
                      "same_logits": same}))
    if not args.keep:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
