"""Which of an ONNX Runtime engine's vision encoder graphs this machine runs (``builder.vision``
writes them): the float32 graph, its INT8-linear form, and each one's form with the native
bfloat16 attention.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...artifacts import EngineError, Manifest, inside
from ...graph.vision import VISION_GRAPH
from ...native import image_attention_bf16, int8_pairs_saturate
from ...native import library as native_library

ENV_VISION_INT8 = "AUTOGLM_TRT_VISION_INT8"  # "0": the float32 linears even where the INT8 ones run


def vision_graph(manifest: Manifest) -> tuple[str, str, Path | None]:
    """The ONNX Runtime engine's encoder graph this machine runs, why, and the native library it
    needs (None: none). Its linears INT8 where the build made them (``vision_linears``) and the CPU
    sums bytes exactly (VNNI, or not x86: ``graph.vision_int8``), else float32; its attention the
    native bfloat16 one where the build made it (``vision_attention``) and the native library runs
    it here (AVX512-BF16), else ONNX Runtime's float32 MultiHeadAttention."""
    built = manifest.vision_forms  # checked as the manifest was read (``record_schema.VisionForms``)
    graphs = built.graphs if built is not None else {}
    natives = (built.native_graphs or {}) if built is not None else {}
    linears, why = "float32", "float32 linears (the build's vision_linears)"
    if "int8" in graphs:
        if os.environ.get(ENV_VISION_INT8) == "0":
            why = f"float32 linears ({ENV_VISION_INT8}=0)"
        elif int8_pairs_saturate():
            why = "float32 linears (this CPU has no VNNI: ONNX Runtime's INT8 products would saturate)"
        else:
            linears, why = "int8", "INT8 linears (activations per token, weights per channel)"
    where = f"{manifest.dir}/manifest.json vision"
    if linears not in natives:
        name = inside(manifest.dir, graphs.get(linears, VISION_GRAPH), f"{where}.graphs", EngineError).name
        return name, why + ", float32 MultiHeadAttention (the build's vision_attention)", None
    library, missing = native_library()
    if library is None or not image_attention_bf16(library):
        name = inside(manifest.dir, graphs.get(linears, VISION_GRAPH), f"{where}.graphs", EngineError).name
        return name, why + ", float32 MultiHeadAttention (" + (
            f"no native library: {missing})" if library is None else "this CPU has no AVX512-BF16)"), None
    name = inside(manifest.dir, natives[linears], f"{where}.native_graphs", EngineError).name
    return name, why + ", bfloat16 attention (native ImageAttentionBf16)", library
