"""The engine manifest: what an engine was built from and with, and checks against this machine.

``manifest.json`` records the source and precision, the SHA-256 of every file in the engine
directory, tool and library versions, the build config, the optimization profiles, the KV
layout and, for TensorRT, the TensorRT version and the GPU (name, compute capability).
``verify`` re-hashes the files; ``diagnose`` also checks the backend on this machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import AutoGLMError
from ..fileutil import sha256_file

MANIFEST = "manifest.json"


class EngineError(AutoGLMError):
    """The engine directory is missing, corrupt, or built for another machine."""


def hash_dir(engine_dir: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(Path(engine_dir).iterdir()) if p.is_file() and p.name != MANIFEST}


def read_manifest(engine_dir: Path) -> dict:
    path = Path(engine_dir) / MANIFEST
    if not Path(engine_dir).is_dir():
        raise EngineError(f"engine directory {engine_dir} does not exist; build one with `autoglm-trt build`")
    if not path.is_file():
        raise EngineError(f"{engine_dir} has no {MANIFEST}; it is not an engine directory made by `autoglm-trt build`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path} is corrupt ({exc}); rebuild the engine") from exc


def verify_files(engine_dir: Path, manifest: dict) -> list[str]:
    """Problems with the engine's files (missing, or a SHA-256 that differs from the manifest)."""
    problems = []
    for name, digest in manifest["files"].items():
        p = Path(engine_dir) / name
        if not p.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(p) != digest:
            problems.append(f"{name} is corrupt or was modified (SHA-256 differs from the manifest)")
    return problems


def backend_problems(manifest: dict) -> list[str]:
    """Why this machine cannot run the engine (empty when it can)."""
    if manifest["backend"] == "onnxruntime":
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return ["onnxruntime is not installed (pip install onnxruntime)"]
        return []
    from .tensorrt_backend import cuda_device, tensorrt_available

    ok, reason = tensorrt_available()
    if not ok:
        return [f"this engine needs TensorRT and an NVIDIA GPU: {reason}"]
    import tensorrt as trt

    problems = []
    built = manifest["tensorrt"]
    if trt.__version__ != built["version"]:
        problems.append(f"engine built with TensorRT {built['version']}, this machine has {trt.__version__}; "
                        "rebuild the engine here (plans are not portable across TensorRT versions)")
    gpu = cuda_device()
    if gpu and gpu["compute_capability"] != built["gpu"]["compute_capability"]:
        problems.append(f"engine built for {built['gpu']['name']} (compute capability "
                        f"{built['gpu']['compute_capability']}), this GPU is {gpu['name']} "
                        f"({gpu['compute_capability']}); rebuild the engine on this GPU")
    return problems


def check_engine(engine_dir: Path, verify_hashes: bool = True) -> dict:
    """Read the manifest and raise ``EngineError`` if files or backend are not right."""
    manifest = read_manifest(engine_dir)
    problems = (verify_files(engine_dir, manifest) if verify_hashes else []) + backend_problems(manifest)
    if problems:
        raise EngineError(f"engine {engine_dir} cannot be used: " + "; ".join(problems))
    return manifest
