"""The native library: ONNX Runtime custom operators for the CPU engine and calibration's
statistics kernels, built at install time (``setup.py``), one build per instruction set.

Input: nothing but the CPU it runs on. Output: ``library()``, the path of the best installed
build this CPU can run (``variants.py``: AVX-512 VNNI, AVX-512, AVX2, generic x86-64; one
generic build elsewhere), or None and why not. No compiler is needed where an engine runs;
without a library (``AUTOGLM_TRT_NATIVE=0``, an install without a C compiler, a CPU no build
fits) the engine graph's own nodes run, which compute the same things more slowly.

Nothing is compiled or looked up at run time: the library is loaded only from this package's
directory, and only when it and that directory belong to this user or root and nobody else may
write them (``trusted``), so another local user cannot plant code in a server.

``AUTOGLM_TRT_NATIVE_VARIANT=<name>`` picks a build by name (tests, and a user who wants to
compare); one this CPU cannot run is refused with the reason. The C sources are in
``csrc/`` (``docs/native.md`` describes them).
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
from pathlib import Path

from .variants import Variant, file_name, for_machine

ENV_SWITCH = "AUTOGLM_TRT_NATIVE"  # "0": never load the library
ENV_VARIANT = "AUTOGLM_TRT_NATIVE_VARIANT"  # a build by name instead of the best one
HERE = Path(__file__).parent


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags as ``/proc/cpuinfo`` names them, or None where that cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return None


def int8_pairs_saturate(flags: set[str] | None = None) -> bool:
    """Whether ONNX Runtime's integer GEMM saturates here: on an x86 CPU without VNNI it multiplies
    u8 by s8 through ``vpmaddubsw``, whose 16-bit pair sums clip (the native Int8Linear does not)."""
    flags = cpu_flags() if flags is None else flags
    return flags is not None and "avx2" in flags and not {"avx512_vnni", "avx_vnni"} & flags


def runs_here(variant: Variant, flags: set[str] | None = None) -> bool:
    """Whether this CPU has what ``variant`` was compiled for (a variant that requires nothing
    runs anywhere; one that does, only where the flags can be read)."""
    if not variant.requires:
        return True
    flags = cpu_flags() if flags is None else flags
    return flags is not None and set(variant.requires) <= flags


def installed() -> dict[str, Path]:
    """The builds present beside this module, by variant name, best first."""
    return {v.name: HERE / file_name(v.name) for v in for_machine() if (HERE / file_name(v.name)).is_file()}


def library(variant: str | None = None) -> tuple[Path | None, str]:
    """(path, "") of the build to load: ``variant``, else ``$AUTOGLM_TRT_NATIVE_VARIANT``, else the best
    installed one this CPU runs; or (None, why not)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0"
    if not sys.platform.startswith("linux"):
        return None, f"the native library is built for Linux only (this is {sys.platform})"
    wanted = variant or os.environ.get(ENV_VARIANT) or None
    builds = installed()
    known = {v.name: v for v in for_machine()}
    flags = cpu_flags()
    if wanted is not None:
        if wanted not in known:
            return None, f"no native build is called {wanted!r}; the builds are {', '.join(known)}"
        if wanted not in builds:
            return None, f"the {wanted} build of the native library is not installed ({HERE})"
        if not runs_here(known[wanted], flags):
            return None, f"this CPU cannot run the {wanted} build (it lacks {', '.join(_missing(known[wanted]))})"
        return _if_trusted(builds[wanted])
    for name, path in builds.items():
        if runs_here(known[name], flags):
            return _if_trusted(path)
    if not builds:
        return None, ("the native library was not built when autoglm-trt was installed (no C compiler then?); "
                      "reinstall with a C compiler on PATH for the native operators")
    return None, f"no installed build of the native library runs on this CPU ({', '.join(builds)})"


def trusted(path: Path) -> str:
    """Why ``path`` (a library about to be loaded) may not be trusted, or "": it and its directory
    must belong to this user or root, and neither may be writable by others, nor by a group other
    than this user's own (a umask of 002 with a group per user is common)."""
    for p in (path, path.parent):
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            return f"{p} is a symbolic link"
        if st.st_uid not in (os.geteuid(), 0):
            return f"{p} belongs to another user (uid {st.st_uid})"
        shared_group = st.st_mode & stat.S_IWGRP and st.st_gid != os.getegid()  # not this user's own group
        if st.st_mode & stat.S_IWOTH or shared_group:
            return f"{p} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it"
    return ""


def _if_trusted(path: Path) -> tuple[Path | None, str]:
    why = trusted(path)
    return (None, f"the native library is not loaded: {why}") if why else (path, "")


def _missing(variant: Variant) -> list[str]:
    return sorted(set(variant.requires) - (cpu_flags() or set()))


def variant_of(path: Path) -> str:
    """The variant name of a library built by ``setup.py`` (or the file name of another build)."""
    for v in for_machine():
        if path.name == file_name(v.name):
            return v.name
    return path.name


def int8_kernel(path: Path) -> str:
    """Which instructions the library's INT8 GEMM uses: "avx512-vnni", "avx2" or "portable C"."""
    return _string(path, "AutoglmInt8Kernel")


def int8_amx(path: Path) -> bool:
    """Whether the library's ``Int8Linear`` runs batches of 16 rows and more on Intel AMX (this CPU
    has it, Linux grants it, and ``AUTOGLM_TRT_AMX`` is not 0)."""
    return bool(ctypes.CDLL(str(path)).AutoglmInt8Amx())


def attention_bf16(path: Path) -> bool:
    """Whether the library's ``PrefillAttentionBf16`` takes its bfloat16 path on Intel AMX here (the
    build has it, this CPU has AMX-BF16, Linux grants it, and ``AUTOGLM_TRT_AMX`` is not 0)."""
    return bool(ctypes.CDLL(str(path)).AutoglmAttentionBf16())


def image_attention_bf16(path: Path) -> bool:
    """Whether the library's ``ImageAttentionBf16`` (the vision encoder's attention in bfloat16) runs
    here: an AVX-512 build on a CPU with AVX512-BF16."""
    return bool(ctypes.CDLL(str(path)).AutoglmImageAttentionBf16())


def block_kernel(path: Path) -> str:
    """Which instructions the library's ``Int4WeightLinear`` and ``Int8BlockLinear`` dot products use
    ("avx512-vnni", "avx2" or "portable C")."""
    return _string(path, "AutoglmBlockKernel")


def float_kernel(path: Path) -> str:
    """Which instructions the library's float GEMM (``FloatLinear``) uses: "avx512", "avx2-fma" or
    "portable C"."""
    return _string(path, "AutoglmFloatKernel")


def softmax_exact(path: Path) -> bool:
    """Whether the library's ``MaskedSoftmax`` computes ONNX Runtime's Softmax bit for bit (a build
    for AVX-512F, where MLAS runs its AVX-512F kernels, whose order it repeats)."""
    return bool(ctypes.CDLL(str(path)).AutoglmSoftmaxExact())


def _string(path: Path, symbol: str) -> str:
    fn = getattr(ctypes.CDLL(str(path)), symbol)
    fn.restype = ctypes.c_char_p
    return fn().decode()
