"""Hashing, version records and all-or-nothing output directories."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import AutoGLMError

_CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_files(paths: list[Path], root: Path | None = None) -> dict[str, str]:
    """``{name: sha256}``; names are relative to ``root`` when given."""
    return {str(p.relative_to(root) if root else p.name): sha256_file(p) for p in paths}


def library_versions(*modules: str) -> dict[str, str]:
    from importlib import metadata

    from . import __version__

    out = {"autoglm-trt": __version__}
    for m in modules:
        try:
            out[m] = metadata.version(m)
        except metadata.PackageNotFoundError:
            out[m] = "not installed"
    return out


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@contextmanager
def staged_directory(out_dir: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir``; on success rename it to ``out_dir``.

    On any error the temporary directory is removed and ``out_dir`` is left as it was, so an
    interrupted or failed run never leaves a half-written result under the real name.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise AutoGLMError(f"output directory {out_dir} already exists; choose another or pass --force to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


def scratch_prefix(out_dir: Path) -> str:
    """The name prefix of a scratch folder beside ``out_dir`` (``tempfile``'s ``prefix``) that
    ``remove_stale_siblings`` removes once this process is gone."""
    return f".{Path(out_dir).name}-scratch-{os.getpid()}-"


def remove_stale_siblings(out_dir: Path) -> list[Path]:
    """Remove the folders beside ``out_dir`` that a run writing it left when it was killed (SIGKILL,
    the out-of-memory killer; SIGTERM and errors clean up after themselves): its staged copy, the
    previous copy it was replacing, its scratch folders, each named with the process id, whose
    process no longer runs on this machine. Returns them."""
    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():
        return []
    name = re.escape(out_dir.name)
    pattern = re.compile(rf"\.{name}(?:\.partial-|\.old-|-scratch-)(\d+)(?:-.*)?")
    removed = []
    for path in out_dir.parent.iterdir():
        found = pattern.fullmatch(path.name)
        if found and path.is_dir() and not path.is_symlink() and not _running(int(found.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or a number no process has: left alone
    return True


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (benchmarks print it: ratios move between CPU kinds)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for servers that tests and benchmarks start)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
