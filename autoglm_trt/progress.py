"""A small progress bar for long loops, on stderr (a line per 10% when not a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label = max(total, 1), label
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1

    def update(self, n: int = 1) -> None:
        self.done += n
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        frac = self.done / self.total
        if self._tty:
            bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:.0f}s eta {eta:.0f}s")
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            decile = int(10 * frac)
            if decile != self._last_decile or self.done >= self.total:
                self._last_decile = decile
                self.stream.write(f"{self.label}: {self.done}/{self.total} ({elapsed:.1f} s)\n")
        self.stream.flush()
