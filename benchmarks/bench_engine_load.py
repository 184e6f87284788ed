#!/usr/bin/env python3
"""A 9B-wide engine's load: its packed weights read from model.native.bin, no pass run.

Writes a synthetic GLM-4-9B-shaped checkpoint cut to ``--layers`` decoder layers (every width and
the vocabulary as GLM-4-9B's: its LM head alone is 0.66 GB at INT8), builds it as an ``int8-wo``
ONNX Runtime engine, and prints its size on disk (``model.native.bin``, the packed weights, apart),
its time to load (the median of ``--rounds`` loads, each in a fresh process, after one to warm the
page cache), and what running the build's passes again would add to each load (the median of as
many runs of ``passes.rewrite`` over its ``model.opt.onnx``, packing included), as loading did
before the packed weights of every size were saved.

    python -m benchmarks.bench_engine_load [--layers 2] [--rounds 3] [--work /tmp/glm9b-load] [--keep]

Needs ~10 GB of free disk and about 10 minutes.
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


def build(ckpt: Path, out: Path) -> None:
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine

    build_engine(BuildRequest(ckpt, out, precision="int8-wo", backend="onnxruntime", force=True,
                              cache_dir=out.parent / ".cache",
                              config=BuildConfig(max_batch_size=1, max_input_len=64, max_seq_len=128,
                                                 kv_num_blocks=16, kv_block_size=16)),
                 log=lambda m: print(m, file=sys.stderr, flush=True))


def child_load(engine: Path) -> None:
    """One load of ``engine`` (the runner's session and pools), checked by one prefill."""
    import numpy as np

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt import passes
    from autoglm_trt.backends.onnxrt.backend import BACKEND as ort
    from autoglm_trt.backends.onnxrt.runner import native_graph_here

    t = time.perf_counter()
    manifest = Manifest.read(engine)
    runner = ort.graph_runner(manifest, 0)
    seconds = time.perf_counter() - t
    logits = runner.logits(np.array([PROMPT], np.int64))[0, -1]
    native = not native_graph_here(manifest.ort_graphs, passes.Target.here())
    print(json.dumps({"seconds": seconds, "native": native and bool(np.isfinite(logits).all())}))


def child_passes(engine: Path) -> None:
    """One run of the build's passes over ``engine``'s optimized graph, its weights packed."""
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt import loader, passes

    manifest = Manifest.read(engine)
    t = time.perf_counter()
    passes.rewrite(engine / loader.OPT_GRAPH, manifest.spec, manifest.kv.dtype, passes.Target.here())
    print(json.dumps({"seconds": time.perf_counter() - t}))


def child(engine: Path, what: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--child", what, str(engine)], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/glm9b-load"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and engines afterwards")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        (child_load if args.child[0] == "load" else child_passes)(Path(args.child[1]))
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
    engine = args.work / "engine"
    build(ckpt, engine)
    child(engine, "load")  # the page cache warmed
    loads = [child(engine, "load") for _ in range(args.rounds)]
    runs = [child(engine, "passes") for _ in range(args.rounds)]
    load_s, passes_s = statistics.median(r["seconds"] for r in loads), statistics.median(r["seconds"] for r in runs)
    print(json.dumps({"layers": args.layers, "engine_gb": round(sum(f.stat().st_size for f in engine.iterdir()) / 1e9, 2),
                      "native_bin_gb": round((engine / "model.native.bin").stat().st_size / 1e9, 2),
                      "native_graph_runs": all(r["native"] for r in loads),
                      "load_s": round(load_s, 2), "passes_s": round(passes_s, 2),
                      "load_with_passes_vs_load": round((load_s + passes_s) / load_s, 1)}))
    if not args.keep:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
