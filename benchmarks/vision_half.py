#!/usr/bin/env python3
"""How far the TensorRT vision engine's half types move a screenshot's image embeddings.

    python -m benchmarks.vision_half [--size 1080x2400] [--seed 3]

The small GLM-4.1V of ``bench_agent_images`` (its vision tower: 4 layers, width 256, 4 heads;
random weights, fixed seed; Open-AutoGLM's max_pixels), one UI-like screenshot. The encoder's
graph as ONNX Runtime runs it (float32, fused attention) against ``graph.vision_trt``'s form,
what a TensorRT build compiles: in float32 (the attention's rewrite alone), in float16 as ONNX
Runtime's CPU computes it, and in float16 and bfloat16 as tensor cores compute it (half operands
and results, float32 sums: ``vision_trt.half_rounded``). One line each: the error's norm relative
to the output's, the largest error relative to the output's largest value, and the lowest cosine
between an image token's two embeddings. No TensorRT runs here; real weights, whose activations
have outliers random ones lack, may move more.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from .bench_agent_images import small_engine
from .common import ROOT, machine


def main() -> None:
    import onnx

    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.backends.onnxrt.vision_encoder import VisionEncoder
    from autoglm_trt.graph.vision_trt import half_rounded, tensorrt_vision_graph
    from autoglm_trt.model.image import ImageConfig, preprocess
    from autoglm_trt.model.screens import ui_screenshot

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1080x2400")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    width, height = (int(x) for x in args.size.split("x"))
    engine = small_engine(ROOT / "engines" / "bench-glm4v")
    vision = ExportRecord.read(engine).vision()
    assert vision is not None
    encoder = VisionEncoder(engine, vision)
    pixels, grids = preprocess([ui_screenshot(args.seed, (width, height))], ImageConfig.from_dir(engine))
    feeds = {"pixel_values": pixels, **encoder.grid_inputs(int(grids[0][1]), int(grids[0][2]))}
    want = encoder.session.run(None, feeds)[0]
    fused = onnx.load(str(engine / "vision.onnx"), load_external_data=False)
    print(machine())
    forms = {"float32": ("float32", False), "float16, ONNX Runtime's CPU": ("float16", False),
             "float16, as tensor cores": ("float16", True), "bfloat16, as tensor cores": ("bfloat16", True)}
    for name, (dtype, rounded) in forms.items():
        form = tensorrt_vision_graph(fused, vision.head_dim, dtype)
        graph = half_rounded(form, dtype) if rounded else form
        got = make_session(graph.SerializeToString(), external_data_dir=engine).run(None, feeds)[0]
        cosine = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        print(json.dumps({"form": name, "patches": int(pixels.shape[0]), "image_tokens": int(want.shape[0]),
                          "relative_error": float(f"{np.linalg.norm(got - want) / np.linalg.norm(want):.2e}"),
                          "max_error_vs_max": float(f"{np.abs(got - want).max() / np.abs(want).max():.2e}"),
                          "lowest_cosine": round(float(cosine.min()), 6)}), flush=True)


if __name__ == "__main__":
    main()
