"""Compile the native library: the one routine ``setup.py`` runs for each variant at install
time, and tests run for builds of their own (the plain-loop build the attention kernels are
compared with, a sanitizer build). Standard library only (``setup.py`` loads it by path).

The output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else cc, gcc or clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def compile_library(out: Path, flags: tuple[str, ...], sources: tuple[str, ...], common: tuple[str, ...],
                    extra: tuple[str, ...] = (), cc: str | None = None) -> None:
    """Build ``sources`` (in ``csrc/``) with ``common + flags + extra`` into the shared library
    ``out``; ``RuntimeError`` with the compiler's message if it fails."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH; install one (e.g. apt-get install gcc)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        units = [str(CSRC / name) for name in sources]
        done = subprocess.run([cc, *common, *flags, *extra, "-o", tmp, *units, "-lm"], capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} could not build {out.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
