"""TensorRT build: ONNX (precision already in the graph) -> serialized plan.

Strongly typed network (TensorRT 10 and 11: no FP16/INT8 builder flags, no calibrator; the
Q/DQ and casts in the ONNX decide precision), one optimization profile for prefill and one for
decode, a timing cache loaded and saved, detailed profiling verbosity so the engine
inspector can name the fused layers. Imported only when the TensorRT backend is asked for;
type-checked against ``tensorrt-stubs``. Nothing here runs without TensorRT and a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import AutoGLMError
from .probe import require_tensorrt

Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]  # input -> (min, opt, max)


def build_plan(onnx_path: Path, out_dir: Path, profiles: dict[str, Profile], workspace_bytes: int,
               optimization_level: int, timing_cache: Path, rewritten: bytes | None = None,
               plan_name: str = "engine.plan") -> dict:
    """Parse, build and save ``plan_name`` + its layers (``layers.json`` for ``engine.plan``,
    ``<plan>.layers.json`` otherwise); return the build report. ``profiles``: the optimization
    profiles in order (the decoder's prefill, then decode; the vision engine's one).

    ``rewritten``: a changed copy of the graph (serialized), whose external weights are still
    beside ``onnx_path`` (the parser resolves them from that path).
    """
    require_tensorrt()
    import tensorrt as trt  # typed by the stubs from here on

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    parsed = (parser.parse_from_file(str(onnx_path)) if rewritten is None
              else parser.parse(rewritten, str(onnx_path)))
    if not parsed:
        errors = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            errors.append(f"node '{e.node_name()}' ({e.node_operator()}): {e.desc()}")
        raise AutoGLMError(f"TensorRT could not parse {onnx_path}:\n  " + "\n  ".join(errors))

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    config.builder_optimization_level = optimization_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    cache_bytes = timing_cache.read_bytes() if timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
        raise AutoGLMError(f"TensorRT refused the timing cache {timing_cache}; delete it and build again")
    for name, shapes in profiles.items():
        profile = builder.create_optimization_profile()
        for tensor, (lo, opt, hi) in shapes.items():
            profile.set_shape(tensor, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
        if config.add_optimization_profile(profile) < 0:
            raise AutoGLMError(f"TensorRT refused the {name} optimization profile {profiles[name]}")

    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise AutoGLMError("TensorRT failed to build the engine; run with TensorRT logging at VERBOSE for details")
    tmp = out_dir / f"{plan_name}.tmp"
    tmp.write_bytes(memoryview(plan))
    tmp.replace(out_dir / plan_name)
    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    serialized = config.get_timing_cache().serialize()
    if serialized is not None:
        tmp_cache = timing_cache.with_name(timing_cache.name + ".tmp")
        tmp_cache.write_bytes(memoryview(serialized))
        tmp_cache.replace(timing_cache)

    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(memoryview(plan))
    inspector = engine.create_engine_inspector()
    layers = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    layers_file = "layers.json" if plan_name == "engine.plan" else f"{Path(plan_name).stem}.layers.json"
    (out_dir / layers_file).write_text(json.dumps(layers, indent=1))
    return {"backend": "tensorrt", "tensorrt_version": trt.__version__, **summarize_layers(layers)}


def summarize_layers(info: dict) -> dict:
    """Fused-layer report from the engine inspector's JSON (``Layers``: list of dicts or names)."""
    layers = info.get("Layers", [])
    kinds: dict[str, int] = {}
    fused = []
    for layer in layers:
        if isinstance(layer, str):
            name, kind = layer, "unknown"
        else:
            name, kind = str(layer.get("Name", "")), str(layer.get("LayerType", "unknown"))
        kinds[kind] = kinds.get(kind, 0) + 1
        if "+" in name or kind in ("Myelin", "myelin"):
            fused.append(name)
    return {"layers": len(layers), "layer_types": dict(sorted(kinds.items())), "fused_layers": fused[:200],
            "fused_count": len(fused)}
