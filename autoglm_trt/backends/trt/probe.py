"""Is TensorRT usable here? The probe every TensorRT path asks first (no TensorRT needed to ask).

``tensorrt_available`` answers (usable, reason): the ``tensorrt`` module importable (not only
its type stubs) and a CUDA GPU visible to ``cuda.bindings``; ``cuda_device`` names GPU 0 and
its compute capability; ``require_tensorrt`` raises with an install hint; ``bfloat16_refusal``
says why a GPU cannot run bfloat16 layers.
"""

from __future__ import annotations

from typing import Any

from ...errors import MissingDependencyError

INSTALL_HINT = ("install TensorRT >= 10 for your CUDA version (pip install 'autoglm-trt[trt]' with NVIDIA's package "
                "index, or the TensorRT tarball) on a machine with an NVIDIA GPU")


def tensorrt_available() -> tuple[bool, str]:
    """(usable, reason): TensorRT importable and a CUDA GPU visible."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        return False, f"the Python module 'tensorrt' is not installed ({exc})"
    if not hasattr(trt, "Builder"):  # e.g. only tensorrt-stubs' .pyi files: a namespace package
        return False, "the Python module 'tensorrt' is not installed (only its type stubs are)"
    gpu = cuda_device()
    if gpu is None:
        return False, "no NVIDIA GPU is visible to cuda-python (cuda.bindings)"
    return True, f"TensorRT {trt.__version__} on {gpu['name']} (compute capability {gpu['compute_capability']})"


def cuda_device() -> dict[str, Any] | None:
    """Name and compute capability of GPU 0, or None."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0 or count < 1:
        return None
    err, prop = cudart.cudaGetDeviceProperties(0)
    if int(err) != 0:
        return None
    name = prop.name.decode(errors="replace").rstrip("\0") if isinstance(prop.name, bytes) else str(prop.name)
    return {"name": name, "compute_capability": f"{prop.major}.{prop.minor}"}


def bfloat16_refusal(gpu: dict[str, Any] | None) -> str | None:
    """Why ``gpu`` (``cuda_device``'s) cannot run bfloat16 layers, or None: TensorRT runs them from
    compute capability 8.0 (Ampere) on."""
    if gpu is None:
        return None
    major, _, minor = str(gpu["compute_capability"]).partition(".")
    if (int(major), int(minor or 0)) >= (8, 0):
        return None
    return (f"{gpu['name']} (compute capability {gpu['compute_capability']}) has no bfloat16; TensorRT needs "
            "compute capability 8.0 (Ampere) or newer for it: set vision_dtype float16 in the build config")


def require_tensorrt() -> None:
    ok, reason = tensorrt_available()
    if not ok:
        raise MissingDependencyError(f"the TensorRT backend cannot run here: {reason}; {INSTALL_HINT}, "
                                     "or use --backend onnxruntime")
