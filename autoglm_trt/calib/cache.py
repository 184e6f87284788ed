"""TensorRT's calibration cache, text format.

One header line ``TRT-<version>-<Algorithm>``, then one ``<tensor name>: <8 hex digits>`` line
per tensor, the hex digits being the big-endian IEEE-754 bits of the float32 scale
``amax / 127``. (Format as written by TensorRT's ``IInt8Calibrator::writeCalibrationCache``
and read back by ``readCalibrationCache``; e.g. amax 1.0 -> scale 0.007874016 -> ``3c010204``.)
"""

from __future__ import annotations

import struct
from pathlib import Path

from ..errors import AutoGLMError

# TensorRT version written in the header: 10.13.0 -> 101300 (MAJOR*10000 + MINOR*100 + PATCH);
# assumed when TensorRT is not installed here (the tensorrt-stubs this project type-checks against)
DEFAULT_TRT_VERSION = 101300
ALGORITHMS = {"entropy": "EntropyCalibration2", "max": "MinMaxCalibration", "percentile": "LegacyCalibration"}


def trt_version() -> tuple[int, str]:
    """(header version, where it came from): the installed TensorRT's, else the assumed 10.13.0."""
    try:
        import tensorrt

        parts = [int(p) for p in str(tensorrt.__version__).split(".")[:3]]
        major, minor, patch = (parts + [0, 0, 0])[:3]
        return major * 10000 + minor * 100 + patch, f"TensorRT {tensorrt.__version__} installed here"
    except (ImportError, AttributeError, ValueError):
        return DEFAULT_TRT_VERSION, "assumed 10.13.0: TensorRT is not installed here"


def scale_to_hex(scale: float) -> str:
    return struct.pack(">f", scale).hex()


def hex_to_scale(text: str) -> float:
    return struct.unpack(">f", bytes.fromhex(text))[0]


def format_cache(amax: dict[str, float], method: str, trt_version: int = DEFAULT_TRT_VERSION) -> str:
    lines = [f"TRT-{trt_version}-{ALGORITHMS[method]}"]
    lines += [f"{name}: {scale_to_hex(value / 127.0)}" for name, value in amax.items()]
    return "\n".join(lines) + "\n"


def write_cache(path: Path, amax: dict[str, float], method: str, trt_version: int = DEFAULT_TRT_VERSION) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(format_cache(amax, method, trt_version), encoding="ascii")
    tmp.replace(path)


def read_cache(path: Path) -> tuple[str, dict[str, float]]:
    """Read a cache: (header, {tensor: scale})."""
    lines = Path(path).read_text(encoding="ascii").splitlines()
    if not lines or not lines[0].startswith("TRT-"):
        raise AutoGLMError(f"{path} is not a TensorRT calibration cache (first line should start with 'TRT-')")
    scales = {}
    for n, line in enumerate(lines[1:], start=2):
        name, sep, value = line.rpartition(": ")
        if not sep or len(value) != 8:
            raise AutoGLMError(f"{path}:{n}: expected '<tensor>: <8 hex digits>', got {line!r}")
        scales[name] = hex_to_scale(value)
    return lines[0], scales
