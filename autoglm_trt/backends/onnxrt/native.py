"""The ONNX Runtime backend's native operators: built on this machine, on first use.

``native_library()`` compiles ``csrc/*.c`` (a custom operator library for ONNX
Runtime's CPU execution provider: ``PagedAttention``, ``PagedAttentionInt8KV``,
``HadamardQuantize``, ``Int8Linear``, ``FloatLinear``, ``RopeQKV``, ``MaskedSoftmax``; and,
called through ctypes, calibration's per-batch statistics, ``calib/native_stats.py``) with the machine's C compiler, for this
CPU (``-march=native``), into a cache directory, and returns its path; or ``None`` and the reason when it cannot (no
compiler, a failed build, or ``AUTOGLM_TRT_NATIVE=0``). The runner then keeps the engine
graph's own nodes, which compute the same things more slowly.

The cache key is the source, the compiler and the CPU, so a changed kernel, compiler or
machine (a home directory shared between machines of two CPU kinds) gets a build of its own.
The library is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("ort_api.h", "chunks.h", "rotate.h", "silu.h", "skip_norm.h", "register.c", "paged_attention.c",
           "hadamard_quantize.c", "int8_linear.c", "rope_qkv.c", "float_linear.c", "masked_softmax.c", "calib_stats.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11", "-fvisibility=hidden"]
ENV_SWITCH = "AUTOGLM_TRT_NATIVE"  # "0": never build or load the native kernel
ENV_CACHE = "AUTOGLM_TRT_CACHE"  # where built libraries are kept (default ~/.cache/autoglm-trt)

_lock = threading.Lock()
_result: dict[str, tuple[Path | None, str]] = {}


def cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "autoglm-trt")
    return Path(root) / "native"


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def native_library(extra_flags: tuple[str, ...] = ()) -> tuple[Path | None, str]:
    """(path of the built library, "") or (None, why not). Built once per process and key.
    ``extra_flags`` (tests): more compiler flags, e.g. ``-mno-avx512f`` for the AVX2 kernels."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) on PATH; install one (e.g. apt-get install gcc)"
    with _lock:
        key = " ".join([cc, *extra_flags])
        if key not in _result:
            _result[key] = _build(cc, FLAGS + list(extra_flags))
        return _result[key]


def int8_kernel(library: Path) -> str:
    """Which instructions the library's INT8 GEMM uses: "avx512-vnni", "avx2" or "portable C"."""
    return _kernel(library, "AutoglmInt8Kernel")


def float_kernel(library: Path) -> str:
    """Which instructions the library's float GEMM (``FloatLinear``) uses: "avx512", "avx2-fma" or
    "portable C"."""
    return _kernel(library, "AutoglmFloatKernel")


def softmax_exact(library: Path) -> bool:
    """Whether the library's ``MaskedSoftmax`` computes ONNX Runtime's Softmax bit for bit (a build
    for AVX-512F, where MLAS runs its AVX-512F kernels, whose order it repeats)."""
    import ctypes

    return bool(ctypes.CDLL(str(library)).AutoglmSoftmaxExact())


def _kernel(library: Path, symbol: str) -> str:
    import ctypes

    fn = getattr(ctypes.CDLL(str(library)), symbol)
    fn.restype = ctypes.c_char_p
    return fn().decode()


def _build(cc: str, flags: list[str]) -> tuple[Path | None, str]:
    try:
        source = "\0".join((CSRC / name).read_text() for name in SOURCES)
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot read the sources in {CSRC} or run {cc} --version: {exc}"
    key = hashlib.sha256("\0".join([source, version, " ".join(flags), _cpu_signature()]).encode())
    out = cache_dir() / f"autoglm_native-{key.hexdigest()[:16]}.so"
    if out.is_file():
        return out, ""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
        units = [str(CSRC / name) for name in SOURCES if name.endswith(".c")]
        build = subprocess.run([cc, *flags, "-o", tmp, *units, "-lm"], capture_output=True, text=True, timeout=300)
        if build.returncode != 0:
            os.unlink(tmp)
            return None, f"{cc} could not build the native operators: {build.stderr.strip()[-500:]}"
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building the native operators failed: {exc}"
    return out, ""
