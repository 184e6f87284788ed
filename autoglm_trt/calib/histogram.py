"""Streamed histograms of |x| and the threshold searches (entropy, max, percentile). Pure numpy.

``AbsHistogram`` keeps 2048 bins over ``[0, range)``, made from 16 x 2048 fine bins. Batches
are merged as they come; when a batch exceeds the fine range, the fine bin width grows by an
integer factor k and old bins are summed k at a time, which is exact (old bin i lies wholly
inside new bin i // k). The 2048 search bins are whole groups of fine bins over the smallest
range that holds the max (at most 1/8 wider than the max), so a range that grew keeps its
resolution. Memory is one 32,768-bin array per tensor, whatever the number of samples.

Entropy search (TensorRT's "entropy calibration", as described by Migacz, "8-bit Inference
with TensorRT", GTC 2017), defined here precisely so that it can be tested:

    for each candidate i in 128..2048 (bins kept):
        P = h[0:i], with the outliers sum(h[i:]) added to P[i-1]
        Q = h[0:i] merged into 128 levels (level j = bins [j*w, (j+1)*w), w = i // 128, the
            last level also takes the remainder up to i), each level's mass spread evenly
            over the bins of that level where P > 0 (0 elsewhere); if the last level has no
            mass of its own but P[i-1] > 0 (only clipped outliers), it gets one count
        KL(P/sum P || Q/sum Q)
    threshold = i* x bin_width for the i* of least KL (the smallest i on ties)

How this differs from TensorRT's published algorithm (Migacz 2017, slide "Entropy
Calibration - pseudocode": ``for i in range(128, 2048)``, threshold ``(m + 0.5) * width``,
``m = argmin``), each on purpose:

* Candidate i = 2048 (keep every bin) is included; the published loop stops at 2047. Effect:
  a distribution best left unclipped (e.g. uniform) gets its max, not 2047.5/2048 of the
  range; elsewhere nothing changes.
* The threshold is the upper edge of the last kept bin, ``i * width``; the published one is
  half a bin higher, ``(m + 0.5) * width``. Effect: ours is lower by half a bin, at most
  0.4% of the threshold (i >= 128).
* Ties go to the smallest i, as ``argmin`` does; divergences within 1e-9 (relative) count as
  ties, so that rounding in the vectorised sums cannot pick a larger i. Same result.
* The one-count rule for a last level with no mass of its own is ours: without it (as in the
  plain description, and in pytorch-quantization) every candidate whose last bin is empty
  has infinite divergence, so a single far outlier forces the threshold to the maximum,
  which is the case calibration is for.

With prefix sums of h, of (h > 0) and of h*log(h), each level's contribution is O(1). Levels
0..126 of a candidate depend only on its level width w = i // 128, which 128 candidates share,
so they are evaluated once per w (16 widths for 2048 bins) as one [16, 127] array, and the
last levels as one [1921] array: no Python loop over bins or candidates.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np

NUM_BINS = 2048
NUM_LEVELS = 128  # |x| quantized to 0..127
FIRST_CANDIDATE = 128


_SCRATCH = threading.local()


def _index_buffer(size: int) -> np.ndarray:
    """A per-thread int64 buffer of ``size`` elements, reused from call to call."""
    buf = getattr(_SCRATCH, "index", None)
    if buf is None or buf.size < size:
        buf = _SCRATCH.index = np.empty(size, np.int64)
    return buf[:size]


class AbsHistogram:
    """Histogram of |x| over all batches added, with an exact running max.

    ``counts``/``width`` are the ``num_bins`` bins the threshold searches read. Underneath,
    ``FINE`` times as many fine bins are accumulated: when a batch exceeds their range they
    merge by an integer factor (exact), and the search bins are then made of whole fine bins
    over the smallest range that holds the max, so they span at most ``1 + 2 / FINE`` times
    the max, however the range grew (the growth of a plain 2048-bin histogram can leave half
    of its bins empty).
    """

    FINE = 16

    def __init__(self, num_bins: int = NUM_BINS):
        self.num_bins = num_bins
        self._counts: np.ndarray | None = np.zeros(num_bins, np.float64)
        self._width = 0.0  # 0 until the first non-zero value
        self.amax = 0.0
        self._fine = np.zeros(num_bins * self.FINE, np.int64)
        self._fine_width = 0.0

    # the search bins are made from the fine ones when read (not after every batch)
    @property
    def counts(self) -> np.ndarray:
        if self._counts is None:
            self._resolve()
        assert self._counts is not None
        return self._counts

    @counts.setter
    def counts(self, value: np.ndarray) -> None:
        self._counts = value

    @property
    def width(self) -> float:
        if self._counts is None:
            self._resolve()
        return self._width

    @width.setter
    def width(self, value: float) -> None:
        self._width = value

    @property
    def range(self) -> float:
        return self.width * self.num_bins

    def add(self, x: np.ndarray, scale: np.ndarray | None = None, in_place: bool = False,
            scratch: np.ndarray | None = None, nonnegative: bool = False) -> None:
        """Add |x| (times ``scale`` along the last axis, if given) to the histogram.

        With ``in_place`` the caller's float32 array is used as scratch space (no copy); with
        ``scratch`` (a float32 array of x's shape) that one is, and x is left as it was.
        ``nonnegative``: x is already |x| (the absolute-value pass is skipped).
        """
        a: np.ndarray = np.asarray(x, dtype=np.float32)
        absolute = scratch is not None and scratch.shape == a.shape and scratch.dtype == np.float32
        if absolute:
            assert scratch is not None
            np.abs(a, out=scratch)  # the copy and the absolute value in one pass
            a = scratch
        elif not in_place or not a.flags.writeable or not a.flags.c_contiguous:
            a = a.copy()
        a = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
        if a.size == 0:
            return
        if scale is not None:
            np.multiply(a, scale, out=a)
        if not (absolute or nonnegative) or scale is not None:
            np.abs(a, out=a)
        self.add_abs(a, float(a.max()))

    def add_abs(self, a: np.ndarray, m: float,
                bin_count: Callable[[np.ndarray, np.float32, np.ndarray], None] | None = None) -> None:
        """Add values that are already absolute (float32, contiguous; used as scratch) whose max
        is ``m``. ``bin_count(a, 1 / fine width, fine bins)`` adds their fine-bin counts, as
        numpy does below (``native_stats``)."""
        if a.size == 0:
            return
        if not math.isfinite(m):
            raise ValueError("activation contains inf or NaN; the float model itself is broken")
        self.amax = max(self.amax, m)
        fine = self._fine.size
        if m == 0.0:
            self._fine[0] += a.size
        else:
            if self._fine_width == 0.0:
                self._fine_width = m / fine
            elif m >= self._fine_width * fine:
                self._grow(math.floor(m / (self._fine_width * fine)) + 1)
            inv = np.float32(1.0 / self._fine_width)
            if bin_count is not None:
                bin_count(a.reshape(-1), inv, self._fine)
            else:
                np.multiply(a, inv, out=a)
                # values at the very top of the range land in bin ``fine`` (or, by rounding, a
                # little above): count them there and fold them into the last bin, instead of a
                # clipping pass. The bin indices go to a reused int64 buffer: bincount takes int64
                # as it is (an int32 array it would first convert, and a fresh one costs page
                # faults every batch).
                index = _index_buffer(a.size)
                np.copyto(index, a.ravel(), casting="unsafe")
                counts = np.bincount(index, minlength=fine)
                self._fine += counts[:fine]
                if counts.size > fine:
                    self._fine[-1] += counts[fine:].sum()
        self._counts = None

    def _grow(self, k: int) -> None:
        merged = np.add.reduceat(self._fine, np.arange(0, self._fine.size, k))
        self._fine = np.zeros(self._fine.size, np.int64)
        self._fine[: merged.size] = merged
        self._fine_width *= k

    def _resolve(self) -> None:
        """``counts``/``width``: ``num_bins`` bins over ``[0, amax]``, from the fine bins.

        Where a search bin's edge falls inside a fine bin, that fine bin's count is shared in
        proportion to the overlap (values are taken as spread evenly within a fine bin, which
        is 1/16 of a search bin), so counts may be fractional.
        """
        if self._fine_width == 0.0:
            self._counts = np.zeros(self.num_bins, np.float64)
            self._counts[0] = self._fine[0]
            return
        cum = np.concatenate([[0.0], np.cumsum(self._fine, dtype=np.float64)])
        self._width = self.amax / self.num_bins
        edges = np.arange(self.num_bins + 1) * (self._width / self._fine_width)  # in fine bins
        edges[-1] = self._fine.size  # the last search bin takes everything up to the top
        below = np.minimum(np.floor(edges).astype(np.int64), self._fine.size - 1)
        frac = edges - below
        at = cum[below] + frac * (cum[below + 1] - cum[below])
        self._counts = np.diff(at)


def entropy_divergences(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(P||Q) of every candidate (see the module docstring): (candidates i, divergences)."""
    h = np.asarray(counts, dtype=np.float64)
    n = h.size
    total = h.sum()
    cand = np.arange(FIRST_CANDIDATE, n + 1)
    if total == 0:
        return cand, np.zeros(cand.size)
    c = np.concatenate([[0.0], np.cumsum(h)])
    nz = np.concatenate([[0.0], np.cumsum(h > 0)])
    hlogh = np.where(h > 0, h * np.log(np.where(h > 0, h, 1.0)), 0.0)
    s = np.concatenate([[0.0], np.cumsum(hlogh)])

    kept = c[cand]  # mass of the first i bins
    outliers = total - kept
    last = h[cand - 1]
    clip = outliers > 0
    w = cand // NUM_LEVELS  # [C]
    # Levels 0..126 of candidate i cover bins [j w, (j + 1) w): the same for every candidate of
    # the same w (16 distinct widths for 2048 bins), so their terms are summed once per w.
    widths = np.unique(w)
    start = widths[:, None] * np.arange(NUM_LEVELS - 1)[None, :]  # [W, L - 1]
    head = _level_terms(c, nz, s, start, start + widths[:, None], 0.0, 0.0).sum(axis=1)[np.searchsorted(widths, w)]
    # The last level runs from 127 w to i. Bin i-1 holds the outliers in P, so it counts as
    # non-zero for Q's expansion; a last level with no mass of its own gets one count (Laplace
    # smoothing), keeping KL finite.
    lo = (NUM_LEVELS - 1) * w
    empty_last = clip & (c[cand] - c[lo] == 0)
    last_terms, per_last = _level_terms(c, nz, s, lo, cand, (clip & (last == 0)).astype(np.float64),
                                        empty_last.astype(np.float64), per_bin=True)
    q_total = kept + empty_last
    with np.errstate(divide="ignore", invalid="ignore"):
        log_norm = np.log(q_total / total)
        kl = head + last_terms + kept * log_norm
        # bin i-1 carries the outliers in P: replace its term
        log_q_last = np.log(per_last)
        old = np.where(last > 0, last * (np.log(np.where(last > 0, last, 1.0)) - log_q_last + log_norm), 0.0)
        new_mass = last + outliers
        new = new_mass * (np.log(np.where(new_mass > 0, new_mass, 1.0)) - log_q_last + log_norm)
        kl = (kl + np.where(clip, new - old, 0.0)) / total
    return cand, kl


def _level_terms(c: np.ndarray, nz: np.ndarray, s: np.ndarray, start: np.ndarray, end: np.ndarray,
                 extra_nonzero: np.ndarray | float, extra_mass: np.ndarray | float, per_bin: bool = False):
    """Each level's KL term ``sum h log h - mass log(Q count of one bin)`` over bins [start, end),
    from the prefix sums ``c`` (of h), ``nz`` (of h > 0), ``s`` (of h log h); Q's mass and
    non-zero bins raised by ``extra_mass`` / ``extra_nonzero``. With ``per_bin``: (terms, Q count
    of one bin)."""
    mass = c[end] - c[start]
    nonzero = nz[end] - nz[start] + extra_nonzero
    mass_q = mass + extra_mass
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.where(mass_q > 0, mass_q / np.where(nonzero > 0, nonzero, 1.0), 1.0)
        terms = np.where(mass > 0, s[end] - s[start] - mass * np.log(one), 0.0)
    return (terms, one) if per_bin else terms


def entropy_amax(hist: AbsHistogram) -> float:
    """Threshold of least KL divergence (TensorRT's entropy calibration)."""
    if hist.width == 0.0:
        return 0.0
    cand, kl = entropy_divergences(hist.counts)
    return min(best_candidate(cand, kl) * hist.width, hist.amax)


def best_candidate(cand: np.ndarray, kl: np.ndarray) -> int:
    """Smallest candidate whose divergence is within rounding (1e-9 relative) of the least."""
    least = float(np.min(kl))
    return int(cand[np.flatnonzero(kl <= least + 1e-9 * abs(least) + 1e-15)[0]])


def percentile_amax(hist: AbsHistogram, percentile: float = 99.99) -> float:
    """Upper edge of the first bin where the cumulative count reaches ``percentile`` %."""
    if hist.width == 0.0:
        return 0.0
    cum = np.cumsum(hist.counts)
    target = cum[-1] * percentile / 100.0
    i = int(np.searchsorted(cum, target, side="left"))
    return min((i + 1) * hist.width, hist.amax)


def max_amax(hist: AbsHistogram) -> float:
    return hist.amax


METHODS = {"entropy": entropy_amax, "max": max_amax, "percentile": percentile_amax}
