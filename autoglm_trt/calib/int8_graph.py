"""Calibration step 3: write the Q/DQ graph of a plan from the export's (smoothed) weights."""

from __future__ import annotations

from pathlib import Path

import onnx

from ..graph.builder import GraphBuilder
from ..graph.decoder import OPSET, DecoderGraph, GraphOptions
from ..graph.quant import QuantPlan
from ..model.spec import ModelSpec
from ..model.weights import WeightSource


def write_int8_graph(out_dir: Path, name: str, spec: ModelSpec, weights: WeightSource, plan: QuantPlan,
                     max_positions: int) -> Path:
    """``out_dir/name`` (+ ``name.data``): the decoder with the plan's linears in INT8."""
    builder = GraphBuilder(out_dir / f"{name}.data")
    try:
        DecoderGraph(builder, spec, weights, GraphOptions("float32", max_positions, plan)).build()
        model = builder.model(f"{spec.family}_paged_decoder_int8", OPSET)
    finally:
        builder.close()
    onnx.save_model(model, str(out_dir / name))
    return out_dir / name
