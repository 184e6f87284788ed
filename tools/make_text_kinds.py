#!/usr/bin/env python3
"""Regenerate the calibration and held-out texts of kinds other than Python documentation:
prose, code and Chinese (``tools/make_calibration_data.py`` makes the Python documentation;
the dialogue kind, ``dialogue.jsonl`` in ``autoglm_trt/calib/data`` and ``calibration/eval``, was
written for this project by hand and is not generated). Calibration and held-out parts of each
kind come from disjoint sources.

    python tools/make_text_kinds.py      # needs apt-get (Debian) and man; output is committed

  prose     the King James Bible (public domain), narrative books, verse numbers removed;
            from Debian's bible-kjv-text, decoded with its bible-kjv reader
  code      Python standard library source files (PSF License 2.0)
  chinese   Simplified Chinese manual pages of Debian's manpages-zh (GFDL 1.2 or later,
            licence text in calibration/LICENSES/), rendered by man as plain text
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "autoglm_trt" / "calib" / "data"  # the calibration part: package data

PROSE = {"data": ["Genesis37:1-45:28", "Exodus1:1-4:31", "Luke15:1-15:32"],
         "eval": ["Ruth1:1-4:22", "Jonah1:1-4:11", "Esther1:1-6:14"]}
CODE = {"data": ["colorsys", "fnmatch", "glob", "shlex", "sched", "graphlib", "netrc", "dataclasses"],
        "eval": ["reprlib", "numbers", "genericpath", "posixpath", "hmac", "linecache"]}
CHINESE = {"data": ["ls", "cp", "mv", "mkdir", "chmod", "tar", "find", "grep", "sed", "sort", "du", "chown"],
           "eval": ["cat", "head", "tail", "wc", "uniq", "cut", "date", "touch", "rm", "ln", "xargs", "tee"]}
MAX_CHARS = {"prose": 60_000, "code": 48_000, "chinese": 20_000}  # per part (data / eval)


def debian_packages(names: list[str], into: Path) -> Path:
    """Download and unpack Debian packages (no installation); returns the unpacked root."""
    subprocess.run(["apt-get", "download", *names], cwd=into, check=True, capture_output=True)
    root = into / "root"
    for deb in sorted(into.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def prose(root: Path, refs: list[str]) -> str:
    out = []
    for ref in refs:
        text = subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l10000", ref],
                              capture_output=True, text=True, check=True).stdout
        chapters: list[list[str]] = []
        for line in text.splitlines():
            if re.match(r"^\S.* \d+$", line):  # a chapter heading, "Genesis 37"
                chapters.append([line.strip() + "\n"])
            elif line.strip() and chapters:
                chapters[-1].append(re.sub(r"^\s*\d+\s+", "", line))  # the verse number removed
        out.extend(c[0] + " ".join(c[1:]) for c in chapters)
    return "\n\n".join(out)


def code(modules: list[str]) -> str:
    import importlib

    return "\n\n".join(f"# file: {m}.py\n" + inspect.getsource(importlib.import_module(m)) for m in modules)


def chinese(root: Path, pages: list[str]) -> str:
    out = []
    env = dict(os.environ, MANWIDTH="100", LANG="C.UTF-8", MAN_KEEP_FORMATTING="0")
    for page in pages:
        try:  # troff loops forever on a few of these pages: skip those
            text = subprocess.run(["man", "-l", str(root / f"usr/share/man/zh_CN/man1/{page}.1.gz")], env=env,
                                  capture_output=True, text=True, check=True, timeout=30).stdout
        except subprocess.TimeoutExpired:
            print(f"skipped man page {page}: man did not finish in 30 s", file=sys.stderr)
            continue
        text = re.sub(r".\x08", "", text)  # overstrike bold/underline
        lines = [re.sub(r"\s+", " ", line).strip() for line in text.splitlines()]
        out.append("\n".join(line for line in lines if line))
    return "\n\n".join(out)


def main() -> None:
    cal = ROOT / "calibration"
    headers = {
        "prose": "# The King James Bible (1611; public domain), from Debian's bible-kjv-text.\n\n",
        "code": f"# Python {sys.version.split()[0]} standard library source, (c) Python Software Foundation, "
                "PSF License 2.0.\n\n",
        "chinese": "# manpages-zh (Chinese translations of manual pages), GFDL 1.2 or later: "
                   "autoglm_trt/calib/LICENSES/GFDL-1.2.txt. From Debian's manpages-zh 1.6.4.\n\n",
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = debian_packages(["bible-kjv", "bible-kjv-text", "manpages-zh"], Path(tmp))
        for part, folder, name in (("data", SHIPPED, "{kind}.txt"), ("eval", cal / "eval", "{kind}.txt")):
            texts = {"prose": prose(root, PROSE[part]), "code": code(CODE[part]),
                     "chinese": chinese(root, CHINESE[part])}
            for kind, text in texts.items():
                (folder / name.format(kind=kind)).write_text(headers[kind] + text[: MAX_CHARS[kind]] + "\n")
    (cal / "LICENSES").mkdir(exist_ok=True)
    shutil.copy("/usr/share/common-licenses/GFDL-1.2", cal / "LICENSES" / "GFDL-1.2.txt")
    for p in sorted(cal.rglob("*")):
        if p.is_file() and p.suffix in (".txt", ".jsonl"):
            print(f"{p.relative_to(cal)}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
