#!/usr/bin/env python3
"""The vision encoder's INT8 linears against its float32 graph and transformers' tower.

    python -m benchmarks.vision_int8 [--rounds 2] [--size 1080x2400]

Two random GLM-4.1V vision towers (fixed seed; Open-AutoGLM's max_pixels, so a 1080 x 2400 UI-like
screenshot is 12,432 patches): the small one of ``bench_agent_images`` (4 layers, width 256,
4 heads: attention over the patches is most of its time) and one layer of GLM-4.1V-9B's own width
(1536, 12 heads of 128, MLP and merger at 4,096 / 13,696). Each is built with ``vision_linears:
int8`` and its screenshot encoded by the float32 graph, the INT8 one (``graph.vision_int8``) and
transformers' ``Glm4vVisionModel`` (float32), in turns, ``--rounds`` times (the median is
printed). Accuracy: per image token, the cosine between the INT8 and the float32 embedding (the
lowest, the first percentile, the mean) and the error's norm relative to the output's. Random
weights have no outlier channels; real weights, whose activations do, may move more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .bench_agent_images import TEXT, VISION, checkpoint
from .common import ROOT, machine

WIDE_VISION = dict(depth=1, hidden_size=1536, num_heads=12, intermediate_size=13696, image_size=336)
WIDE_TEXT = dict(hidden_size=4096, intermediate_size=256, num_hidden_layers=1, num_attention_heads=32,
                 num_key_value_heads=2, head_dim=128, max_position_embeddings=16384, mrope_section=[8, 12, 12])
TOWERS = {"small (4 x 256)": ("bench-glm4v", VISION, TEXT), "9B width (1 x 1536)": ("bench-glm4v-wide", WIDE_VISION,
                                                                                   WIDE_TEXT)}


def engine(work: Path, vision: dict, text: dict) -> Path:
    """``work``/engine-int8-vision: an fp32 engine with the INT8 encoder beside the float one."""
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine
    from autoglm_trt.graph.vision_int8 import INT8_VISION_GRAPH

    from .bench_agent_images import is_current

    out = work / "engine-int8-vision"
    if not (is_current(out) and (out / INT8_VISION_GRAPH).is_file()):
        build_engine(BuildRequest(checkpoint(work / "checkpoint", vision, text), out, precision="fp32",
                                  backend="onnxruntime", force=out.exists(),
                                  config=BuildConfig(max_seq_len=8192, max_input_len=2048, max_batch_size=4,
                                                     vision_linears="int8")),
                     log=lambda m: print(m, file=sys.stderr))
    return out


def measure(name: str, work: Path, vision_config: dict, text_config: dict, rounds: int, size: tuple[int, int]) -> dict:
    """One tower's line: the three encoders' median seconds, and the INT8 embeddings' accuracy."""
    import torch
    import transformers

    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.graph.vision_int8 import INT8_VISION_GRAPH
    from autoglm_trt.graph.vision_runner import VisionEncoder
    from autoglm_trt.model.image import ImageConfig, preprocess
    from autoglm_trt.model.screens import ui_screenshot

    built = engine(work, vision_config, text_config)
    vision = ExportRecord.read(built).vision()
    assert vision is not None
    pixels, grids = preprocess([ui_screenshot(3, size)], ImageConfig.from_dir(built))
    grid = (int(grids[0][0]), int(grids[0][1]), int(grids[0][2]))
    floats, int8 = VisionEncoder(built, vision), VisionEncoder(built, vision, graph=INT8_VISION_GRAPH)
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(work / "checkpoint"),
                                                                    dtype=torch.float32).eval()

    def transformers_tower():
        with torch.no_grad():
            return model.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids))

    runs = {"float32": lambda: floats.encode(pixels, grid), "int8": lambda: int8.encode(pixels, grid),
            "transformers": transformers_tower}
    times: dict[str, list[float]] = {k: [] for k in runs}
    outputs = {}
    for _ in range(rounds):
        for key, run in runs.items():
            t0 = time.perf_counter()
            outputs[key] = run()
            times[key].append(time.perf_counter() - t0)
    want, got = outputs["float32"], outputs["int8"]
    cosine = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    seconds = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return {"tower": name, "patches": int(pixels.shape[0]), "image_tokens": int(want.shape[0]), "encode_s": seconds,
            "int8_over_float32": round(seconds["int8"] / seconds["float32"], 3),
            "int8_over_transformers": round(seconds["int8"] / seconds["transformers"], 3),
            "cosine_lowest": round(float(cosine.min()), 6), "cosine_p1": round(float(np.percentile(cosine, 1)), 6),
            "cosine_mean": round(float(cosine.mean()), 6),
            "relative_error": float(f"{np.linalg.norm(got - want) / np.linalg.norm(want):.2e}")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", default="1080x2400")
    args = ap.parse_args()
    width, height = (int(x) for x in args.size.split("x"))
    print(machine(), flush=True)
    for name, (folder, vision_config, text_config) in TOWERS.items():
        print(json.dumps(measure(name, ROOT / "engines" / folder, vision_config, text_config, args.rounds,
                                 (width, height))), flush=True)


if __name__ == "__main__":
    main()
