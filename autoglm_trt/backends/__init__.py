"""Backends, each a loader and a runner as Polygraphy pairs them.

* ``onnxrt``: the loader applies ONNX Runtime's graph optimizations once and saves the
  optimized model; the runner runs steps on the CPU with I/O binding.
* ``trt``: the loader builds a TensorRT plan from the ONNX; the runner runs it with
  ``execute_async_v3`` over ``cuda.bindings`` device buffers. ``trt.probe`` says whether
  TensorRT and a GPU are usable here.

Each is a ``base.Backend`` (its traits, build and run), registered by name in ``registry``.
``open_runner`` turns an engine's manifest into a runner of the one step contract
(``base.StepRunner``); ``backend_problems`` says why this machine cannot run an engine.
"""

from __future__ import annotations

from ..artifacts import EngineError, Manifest
from .base import StepRunner


def backend_problems(manifest: Manifest) -> list[str]:
    """Why this machine cannot run the engine (empty when it can)."""
    from .registry import backend

    return backend(manifest.backend).problems(manifest)


def engine_file_problems(manifest: Manifest) -> list[str]:
    """Whether the engine file is what its backend loads (an ONNX model for ONNX Runtime)."""
    from .registry import backend

    return backend(manifest.backend).file_problems(manifest)


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
    ``spinning`` are ONNX Runtime's (``backends.onnxrt.session.session_options``)."""
    from .registry import backend

    return backend(manifest.backend).open_runner(manifest, num_blocks, threads, spinning)


__all__ = ["StepRunner", "backend_problems", "check_engine", "engine_file_problems", "open_runner"]
