"""Backends, each a loader and a runner as Polygraphy pairs them.

* ``onnxrt``: the loader applies ONNX Runtime's graph optimizations once and saves the
  optimized model; the runner runs steps on the CPU with I/O binding.
* ``trt``: the loader builds a TensorRT plan from the ONNX; the runner runs it with
  ``execute_async_v3`` over ``cuda.bindings`` device buffers. ``trt.probe`` says whether
  TensorRT and a GPU are usable here.

``open_runner`` turns an engine's manifest into a runner of the one step contract
(``base.StepRunner``); ``backend_problems`` says why this machine cannot run an engine.
"""

from __future__ import annotations

from ..artifacts import EngineError, Manifest
from .base import StepRunner


def backend_problems(manifest: Manifest) -> list[str]:
    """Why this machine cannot run the engine (empty when it can)."""
    if manifest.backend == "onnxruntime":
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return ["onnxruntime is not installed (pip install onnxruntime)"]
        return []
    from .trt.probe import cuda_device, tensorrt_available

    ok, reason = tensorrt_available()
    if not ok:
        return [f"this engine needs TensorRT and an NVIDIA GPU: {reason}"]
    import tensorrt as trt

    problems = []
    built = manifest.data["tensorrt"]
    if trt.__version__ != built["version"]:
        problems.append(f"engine built with TensorRT {built['version']}, this machine has {trt.__version__}; "
                        "rebuild the engine here (plans are not portable across TensorRT versions)")
    gpu = cuda_device()
    if gpu and gpu["compute_capability"] != built["gpu"].get("compute_capability"):
        problems.append(f"engine built for {built['gpu'].get('name')} (compute capability "
                        f"{built['gpu'].get('compute_capability')}), this GPU is {gpu['name']} "
                        f"({gpu['compute_capability']}); rebuild the engine on this GPU")
    return problems


def engine_file_problems(manifest: Manifest) -> list[str]:
    """Whether the engine file is what its backend loads (an ONNX model for ONNX Runtime)."""
    if manifest.backend != "onnxruntime" or not manifest.engine_path.is_file():
        return []
    import onnx

    try:
        onnx.load(str(manifest.engine_path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types for a file that is not ONNX
        return [f"{manifest.engine_path.name} is not a valid ONNX model ({type(exc).__name__}); rebuild the engine"]
    return []


def check_engine(engine_dir, verify_hashes: bool = True) -> Manifest:
    """Read the manifest and raise ``EngineError`` if files or backend are not right."""
    manifest = Manifest.read(engine_dir)
    problems = (manifest.verify_files() if verify_hashes else []) + backend_problems(manifest)
    problems = problems or engine_file_problems(manifest)
    if problems:
        raise EngineError(f"engine {engine_dir} cannot be used: " + "; ".join(problems))
    return manifest


def open_runner(manifest: Manifest, num_blocks: int, threads: int = 0, spinning: bool = True) -> StepRunner:
    """The runner of an engine's backend with a pool of ``num_blocks`` KV blocks; ``threads`` and
    ``spinning`` are ONNX Runtime's (``graph.session.session_options``)."""
    kv, limits = manifest.kv, manifest.limits
    if manifest.backend == "onnxruntime":
        from .onnxrt.runner import OrtRunner

        return OrtRunner(manifest.dir, manifest.ort_graphs, manifest.spec, num_blocks, kv.block_size, kv.dtype, threads,
                         spinning=spinning)
    from .trt.runner import TrtRunner

    return TrtRunner(manifest.engine_path, manifest.spec, num_blocks, kv.block_size, kv.dtype,
                     limits.max_batch_size, limits.max_input_len, limits.max_seq_len)


__all__ = ["StepRunner", "backend_problems", "check_engine", "engine_file_problems", "open_runner"]
