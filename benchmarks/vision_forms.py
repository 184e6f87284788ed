#!/usr/bin/env python3
"""The vision encoder's fast forms (INT8 linears, bfloat16 attention) against its float32 graph
and transformers' tower.

    python -m benchmarks.vision_forms [--rounds 2] [--size 1080x2400]

Two random GLM-4.1V vision towers (fixed seed; Open-AutoGLM's max_pixels, so a 1080 x 2400 UI-like
screenshot is 12,432 patches): the small one of ``bench_agent_images`` (4 layers, width 256,
4 heads: attention over the patches is most of its time) and one layer of GLM-4.1V-9B's own width
(1536, 12 heads of 128, MLP and merger at 4,096 / 13,696). Each is built with ``vision_linears:
int8`` and ``vision_attention: bfloat16``, and its screenshot encoded by the float32 graph, the
INT8-linear one (``graph.vision_int8``), each of those with the native bfloat16 attention
(``ImageAttentionBf16``, where this CPU has AVX512-BF16) and transformers' ``Glm4vVisionModel``
(float32), in turns, ``--rounds`` times (the median is printed). Accuracy: per image token, the
cosine between each form's embedding and the float32 graph's (the lowest, the first percentile,
the mean) and the error's norm relative to the output's. Random weights have no outlier
channels; real weights, whose activations do, may move more.
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
    """``work``/engine-fast-vision: an fp32 engine with the encoder's fast forms beside the float one."""
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine
    from autoglm_trt.graph.vision_int8 import INT8_VISION_GRAPH

    from .bench_agent_images import is_current

    out = work / "engine-fast-vision"
    if not (is_current(out) and (out / INT8_VISION_GRAPH.replace(".onnx", ".native.onnx")).is_file()):
        build_engine(BuildRequest(checkpoint(work / "checkpoint", vision, text), out, precision="fp32",
                                  backend="onnxruntime", force=out.exists(),
                                  config=BuildConfig(max_seq_len=8192, max_input_len=2048, max_batch_size=4,
                                                     vision_linears="int8", vision_attention="bfloat16")),
                     log=lambda m: print(m, file=sys.stderr))
    return out


def measure(name: str, work: Path, vision_config: dict, text_config: dict, rounds: int, size: tuple[int, int]) -> dict:
    """One tower's line: each encoder's median seconds, and each fast form's accuracy."""
    import torch
    import transformers

    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.backends.onnxrt.vision_encoder import VisionEncoder
    from autoglm_trt.model.image import ImageConfig, preprocess
    from autoglm_trt.model.screens import ui_screenshot
    from autoglm_trt.native import image_attention_bf16
    from autoglm_trt.native import library as native_library

    built = engine(work, vision_config, text_config)
    vision = ExportRecord.read(built).vision()
    assert vision is not None
    pixels, grids = preprocess([ui_screenshot(3, size)], ImageConfig.from_dir(built))
    grid = (int(grids[0][0]), int(grids[0][1]), int(grids[0][2]))
    library = native_library()[0]
    forms = {"float32": "vision.onnx", "int8_linears": "vision.int8.onnx"}
    if library is not None and image_attention_bf16(library):
        forms.update({"bf16_attention": "vision.native.onnx", "int8_linears_bf16_attention": "vision.int8.native.onnx"})
    encoders = {k: VisionEncoder(built, vision, graph=g, custom_ops=library if "native" in g else None)
                for k, g in forms.items()}
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(work / "checkpoint"),
                                                                    dtype=torch.float32).eval()

    def transformers_tower():
        with torch.no_grad():
            return model.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids))

    runs = {**{k: (lambda e=e: e.encode(pixels, grid)) for k, e in encoders.items()}, "transformers": transformers_tower}
    times: dict[str, list[float]] = {k: [] for k in runs}
    outputs = {}
    for _ in range(rounds):
        for key, run in runs.items():
            t0 = time.perf_counter()
            outputs[key] = run()
            times[key].append(time.perf_counter() - t0)
    want = outputs["float32"]
    seconds = {k: round(statistics.median(v), 2) for k, v in times.items()}
    accuracy = {}
    for key in forms:
        if key == "float32":
            continue
        got = outputs[key]
        cosine = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        accuracy[key] = {"cosine_lowest": round(float(cosine.min()), 6),
                         "cosine_p1": round(float(np.percentile(cosine, 1)), 6),
                         "cosine_mean": round(float(cosine.mean()), 6),
                         "relative_error": float(f"{np.linalg.norm(got - want) / np.linalg.norm(want):.2e}")}
    return {"tower": name, "patches": int(pixels.shape[0]), "image_tokens": int(want.shape[0]), "encode_s": seconds,
            "over_transformers": {k: round(v / seconds["transformers"], 3) for k, v in seconds.items()
                                  if k != "transformers"},
            "accuracy_vs_float32": accuracy}


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
