"""The vision encoder's part of a build (image-text models): on TensorRT its engine
(``vision.plan``), on ONNX Runtime the export's float32 graph with its fast forms beside it (INT8
linears, ``graph.vision_int8``; the native bfloat16 attention, ``passes/image_attention.py``),
which the runtime chooses among on the machine it runs on (``backends.onnxrt.vision``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..artifacts import ExportRecord
from ..backends.base import Backend
from ..errors import AutoGLMError
from ..model.vision import VisionSpec
from .config import BuildConfig


def vision_engine(backend: Backend, model_dir: Path, record: ExportRecord, tmp: Path, cfg: BuildConfig,
                  eight_bits: bool, timing: Path, report: dict, log: Callable[[str], None]) -> None:
    """An image-text model's vision encoder in the build (``report["vision"]``): its engine where
    the backend compiles one (TensorRT; ``timing``: its timing cache), else (ONNX Runtime) the
    export's float32 graph, with INT8 linears (``vision_linears``) its INT8 form beside it, and with
    bfloat16 attention (``vision_attention``) each one's native form; ``auto`` for either is on where the decoder
    rounds its activations to 8 bits anyway (``eight_bits``)."""
    if record.vision() is None:
        return
    if backend.traits.compiled_vision:
        report["vision"] = _vision_plan(model_dir, record, tmp, cfg, timing, log)
        return
    if cfg.vision_dtype != BuildConfig.vision_dtype:
        log(f"vision_dtype {cfg.vision_dtype} is for a TensorRT vision engine; ONNX Runtime's encoder runs "
            "float32 or INT8 linears (vision_linears)")
    linears = cfg.vision_linears if cfg.vision_linears != "auto" else ("int8" if eight_bits else "float32")
    attention = cfg.vision_attention if cfg.vision_attention != "auto" else ("bfloat16" if eight_bits else "float32")
    graph = record.vision_files()[0]
    report["vision"] = {"linears": linears, "attention": attention, "graphs": {"float32": graph.name}}
    if linears == "int8":
        report["vision"]["graphs"]["int8"], report["vision"]["int8_linears"] = _int8_vision(graph, tmp, log)
    if attention == "bfloat16":
        spec = record.vision()
        assert spec is not None  # checked above
        report["vision"]["native_graphs"] = _native_vision(report["vision"]["graphs"], graph.parent, tmp, spec, log)


def _int8_vision(graph: Path, tmp: Path, log: Callable[[str], None]) -> tuple[str, int]:
    """``vision.int8.onnx`` beside the float32 encoder: its linears INT8 (``graph.vision_int8``); and
    how many linears it has."""
    import onnx

    from ..graph.vision_int8 import INT8_VISION_GRAPH, int8_vision_graph

    model, count = int8_vision_graph(onnx.load(str(graph)))
    onnx.save_model(model, str(tmp / INT8_VISION_GRAPH), save_as_external_data=True,
                    location=f"{INT8_VISION_GRAPH}.data", size_threshold=1024)
    log(f"vision encoder: {count} linears INT8 ({INT8_VISION_GRAPH}), run where the CPU sums bytes exactly "
        "(VNNI, or not x86), else the float32 graph")
    return INT8_VISION_GRAPH, count


def _native_vision(graphs: dict[str, str], export_dir: Path, tmp: Path, vision: VisionSpec,
                   log: Callable[[str], None]) -> dict:
    """Each encoder graph's form with the native bfloat16 attention (``<name>.native.onnx``, a graph
    naming its base's weights), by the same keys; none where the head size does not fit it."""
    import onnx

    from ..backends.onnxrt.passes.image_attention import HEAD_SIZES, native_image_attention

    made = {}
    for key, name in graphs.items():
        base = tmp / name if (tmp / name).is_file() else export_dir / name
        model, count = native_image_attention(onnx.load(str(base), load_external_data=False), vision.head_dim)
        if count:
            made[key] = name.removesuffix(".onnx") + ".native.onnx"
            onnx.save_model(model, str(tmp / made[key]))
    log(f"vision encoder: attention in bfloat16 ({', '.join(made.values())}) where the native library runs "
        "ImageAttentionBf16 (AVX512-BF16), else float32" if made else
        f"vision encoder: head size {vision.head_dim} is not one ImageAttentionBf16 takes ({HEAD_SIZES}); "
        "attention stays float32")
    return made


def _vision_plan(model_dir: Path, record: ExportRecord, tmp: Path, cfg: BuildConfig, timing: Path,
                 log: Callable[[str], None]) -> dict:
    """A TensorRT engine of the vision encoder (``vision.plan``): its graph in TensorRT's form
    (``graph.vision_trt``: plain attention, linears and attention in ``cfg.vision_dtype``), one
    profile over the patch count up to ``max_pixels``."""
    import onnx

    from ..backends.trt.loader import build_plan
    from ..backends.trt.probe import bfloat16_refusal, cuda_device
    from ..backends.trt.vision import VISION_PLAN
    from ..graph.vision_trt import tensorrt_vision_graph
    from ..model.image import ImageConfig
    from .profiles import vision_profile

    vision = record.vision()
    assert vision is not None
    graph = record.vision_files()[0]
    max_pixels = cfg.max_pixels or ImageConfig.from_dir(model_dir).max_pixels
    if cfg.vision_dtype == "bfloat16" and (refusal := bfloat16_refusal(cuda_device())):
        raise AutoGLMError(refusal)
    form = tensorrt_vision_graph(onnx.load(str(graph), load_external_data=False), vision.head_dim, cfg.vision_dtype)
    log(f"building the {cfg.vision_dtype} vision engine for images of up to {max_pixels} pixels "
        f"({vision.max_patches(max_pixels)} patches)")
    report = build_plan(graph, tmp, vision_profile(vision, max_pixels), cfg.workspace_bytes,
                        cfg.builder_optimization_level, timing, form.SerializeToString(), VISION_PLAN)
    return {**report, "dtype": cfg.vision_dtype}
