"""The builds of the native library: one per instruction set, all made at install time, the best
one this CPU runs chosen when it is loaded (ggml's ``GGML_CPU_ALL_VARIANTS``).

Standard library only: ``setup.py`` loads this file by path, before the package is installed.
Each variant is the same sources compiled for a baseline of the x86-64 psABI levels (and the
one extension the INT8 kernel wants); the sources pick their kernels with the compiler's
feature macros. ``requires`` lists the ``/proc/cpuinfo`` flags a CPU needs to run the build.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

# ISO C with no contraction of multiplies and adds (GCC's default there, not Clang's), which the
# kernels' bit-for-bit sums rely on; every warning an error, but Clang's note that it left a
# ``#pragma omp simd`` loop scalar (GCC ignores the unknown -Wno-); OpenMP's simd pragmas without
# its runtime
COMMON_FLAGS = ("-O3", "-std=c11", "-ffp-contract=off", "-fPIC", "-shared", "-fvisibility=hidden", "-fopenmp-simd",
                "-Wall", "-Wextra", "-Werror", "-Wno-pass-failed")
SOURCES = ("register.c", "paged_attention.c", "hadamard_quantize.c", "int8_linear.c", "rope_qkv.c",
           "float_linear.c", "masked_softmax.c", "calib_stats.c", "block_linear.c", "prefill_attention.c", "amx.c",
           "kv_quantize.c", "image_attention.c")
HEADERS = ("ort_api.h", "operators.h", "parallel.h", "simd.h", "vec.h", "linear.h", "chunks.h", "rotate.h",
           "skip_norm.h", "tile_runs.h", "amx.h", "block_tiles_vnni.h", "block_tiles_avx2.h", "block_tiles_c.h")

_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
_V3 = _V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    requires: tuple[str, ...]


X86_64 = (  # best first
    Variant("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 + ("avx512_vnni",)),
    Variant("avx512", ("-march=x86-64-v4",), _V4),
    Variant("avx2", ("-march=x86-64-v3",), _V3),
    Variant("generic", ("-march=x86-64",), ()),
)
OTHER = (Variant("generic", (), ()),)


def for_machine(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built for this architecture, best first."""
    machine = (machine or platform.machine()).lower()
    return X86_64 if machine in ("x86_64", "amd64") else OTHER


def file_name(variant: str) -> str:
    return f"libautoglm-{variant}.so"
