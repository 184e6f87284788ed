"""Which linears to keep in float: a measured end-to-end ranking, and the fewest that meet the gate.

All of it runs on one "switchable" INT8 graph whose ``quant_mask`` input turns each linear's
Q/DQ on or off, so trying a plan is one forward pass, not a graph rebuild.

* Ranking: end to end, each linear by the mean KL(float || INT8) of the logits on a few
  calibration windows with that linear alone INT8. One linear's rounding stays one linear's
  (none later re-rounds it), so this is steady; on SmolLM2 it puts two down projections (layers
  28 and 11) first, and the first alone in float brings the gate's expected ppl ratio below its
  target. Ranking by kind and then by each linear's own output error puts those two last of the
  30 downs and needs many linears in float where this needs one; leave-one-out (every linear INT8
  but one) ranks worse too: each removal is a small change to a sum re-rounded by every later
  layer (docs/calibration.md).
* Search: keep the top k in float with k = 0, 1, 2, 4, ... until the gate (expected perplexity
  ratio and top-1 agreement against the float graph on held-back calibration windows, ``Gate``)
  holds, then bisect between the last failing and the first passing k.
* Stability: an INT8 graph turns a rounding difference in x (another BLAS, another instruction
  set) into a different integer wherever x / s lies near a rounding boundary, and each such
  difference is re-rounded, and so spread, by every later layer: two equivalent roundings give
  two draws of the same quantization noise. The gate therefore judges the expected perplexity
  ratio (from the KL divergence: far steadier than the measured ratio between draws), and a
  plan whose verdict is not clear under one rounding is judged on the mean of two (the
  activation scales as planned, and nudged by ``NUDGE``); the ranking's ties break by name.
* Bias correction: each linear's mean INT8 output error on the sampled rows, added to its
  output, kept for a kind of linear only where it lowers the expected perplexity ratio.

"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np

from ..backends.onnxrt.offline import prefill_feeds
from ..graph.metrics import kl_rows, log_softmax, next_token_scores
from ..graph.names import kind_of
from ..model.spec import ModelSpec
from ..progress import Progress
from ..quant.int8 import act_scale, quantize_weight_per_channel

RANK_WINDOWS = 2
# the search's second rounding: every activation scale this much larger moves each quotient x / s
# by 4e-6 of itself, so those that near a rounding boundary cross it, as another BLAS's or
# instruction set's rounding of x would
NUDGE = 1.0 + 2.0**-18
RANK_SEQ_LEN = 128
# (expected ppl ratio, top-1 agreement): a check this far from both targets (or this far past
# either) is decided by one rounding. Five and four times the largest standard deviation of each
# between roundings of one plan on SmolLM2's gate (docs/calibration.md). The INT8 graph's final
# check is another rounding, held to the targets loosened by as much.
CLEAR = (0.002, 0.01)
# a kind's bias corrections are kept where they lower the expected ppl ratio by more than this: a
# gain is the difference of two checks, each with its rounding's noise (on SmolLM2 one kind's
# measured gain varied from one calibration to the next by as much as its own size)
MIN_GAIN = CLEAR[0]


def fake_quant_act(x: np.ndarray, amax: float) -> np.ndarray:
    s = act_scale(amax)
    return np.clip(np.rint(x / s), -127, 127) * s


def output_error(x: np.ndarray, w: np.ndarray, amax: float) -> float:
    """Relative output error of INT8 ``x @ w`` (w is ``[in, out]``)."""
    diff, ref = output_error_norms(x, w, amax)
    return diff / max(ref, 1e-30)


def output_error_norms(x: np.ndarray, w: np.ndarray, amax: float) -> tuple[float, float]:
    """(||x w - INT8(x) INT8(w)||, ||x w||): Frobenius norms, which add up in squares over column chunks of w."""
    y = x @ w
    wq, ws = quantize_weight_per_channel(w)
    yq = fake_quant_act(x, amax) @ (wq.astype(np.float32) * ws)
    return float(np.linalg.norm(y - yq)), float(np.linalg.norm(y))


def mean_output_error(x: np.ndarray, w: np.ndarray, amax: float) -> np.ndarray:
    """Bias correction of an INT8 linear: the mean over the rows of x of ``x w - INT8(x) INT8(w)``
    ``[out]`` (means first: the product is linear in the rows)."""
    wq, ws = quantize_weight_per_channel(w)
    ref = x.astype(np.float64).mean(0) @ w.astype(np.float64)
    quant = fake_quant_act(x, amax).astype(np.float64).mean(0) @ (wq.astype(np.float64) * ws)
    return (ref - quant).astype(np.float32)


def fewest_float(ranked: list[str], passes: Callable[[list[str]], bool], log: Callable[[str], None],
                 kept: str = "in float") -> list[str] | None:
    """Smallest prefix of ``ranked`` to keep (in float) for which ``passes`` holds (None if none does)."""
    if passes([]):
        return []
    lo, k = 0, 1  # lo: largest k known to fail
    while True:
        k = min(k, len(ranked))
        if passes(ranked[:k]):
            break
        lo = k
        if k == len(ranked):
            return None
        k *= 2
    hi = k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(ranked[:mid]):
            hi = mid
        else:
            lo = mid
    log(f"sensitivity: {hi} of {len(ranked)} linears kept {kept}")
    return ranked[:hi]


class Gate:
    """A model's perplexity ratio and top-1 agreement against a float reference on fixed windows.

    It passes on the *expected* perplexity ratio, ``exp(mean KL(reference || model))`` over the
    windows' next-token distributions: the ratio the model would have, on average, on text the
    reference wrote. The measured ratio (``ppl_ratio``, recorded too) is the same quantity plus
    each token's chance: an INT8 model's per-token losses move when any rounding upstream
    changes, so on the gate's 3,000 tokens the measured ratio moves between equivalent roundings
    many times more than the expected one does (SmolLM2, docs/calibration.md).
    """

    def __init__(self, windows: np.ndarray, max_ratio: float, min_top1: float,
                 ref_logits: Callable[[np.ndarray], np.ndarray], batch: int = 4):
        self.windows, self.max_ratio, self.min_top1, self.batch = windows, max_ratio, min_top1, batch
        self.ref = [next_token_scores(ref_logits(w), w, np.float32) for w in self._batches()]
        self.ref_nll = np.concatenate([nll for _, nll in self.ref])
        self.ref_top = [lp.argmax(-1) for lp, _ in self.ref]

    def _batches(self) -> list[np.ndarray]:
        return [self.windows[b : b + self.batch] for b in range(0, len(self.windows), self.batch)]

    def check(self, fn: Callable[[np.ndarray], np.ndarray], slack: tuple[float, float] = (0.0, 0.0)) -> dict:
        """The metrics of ``fn``; passed where they meet the targets, each loosened by ``slack``
        (expected ratio, top-1)."""
        nll, agree, kl = [], [], []
        for w, (ref_lp, _), ref_top in zip(self._batches(), self.ref, self.ref_top):
            lp, w_nll = next_token_scores(fn(w), w, np.float32)
            nll.append(w_nll)
            agree.append(lp.argmax(-1) == ref_top)
            kl.append(kl_rows(ref_lp, lp))
        mean_nll, mean_kl = float(np.concatenate(nll).mean()), float(np.concatenate(kl).mean())
        ppl, ref_ppl = float(np.exp(mean_nll)), float(np.exp(self.ref_nll.mean()))
        return self._verdict({"ppl": ppl, "ref_ppl": ref_ppl, "ppl_ratio": ppl / ref_ppl, "kl": mean_kl,
                              "expected_ppl_ratio": float(np.exp(mean_kl)),
                              "top1_agreement": float(np.concatenate(agree).mean())}, slack)

    def _verdict(self, r: dict, slack: tuple[float, float] = (0.0, 0.0)) -> dict:
        return {**r, "passed": r["expected_ppl_ratio"] <= self.max_ratio + slack[0]
                and r["top1_agreement"] >= self.min_top1 - slack[1]}

    def clear(self, r: dict) -> bool:
        """Whether ``r``'s verdict lies beyond what another rounding could move (``CLEAR``)."""
        fails = r["expected_ppl_ratio"] > self.max_ratio + CLEAR[0] or r["top1_agreement"] < self.min_top1 - CLEAR[1]
        passes = r["expected_ppl_ratio"] < self.max_ratio - CLEAR[0] and r["top1_agreement"] > self.min_top1 + CLEAR[1]
        return fails or passes

    def mean(self, a: dict, b: dict) -> dict:
        """The mean of two checks' metrics (two roundings of one plan), their verdict and ``spread``."""
        keys = ("ppl", "ppl_ratio", "kl", "expected_ppl_ratio", "top1_agreement")
        return self._verdict({**a, **{k: (a[k] + b[k]) / 2 for k in keys},
                              "spread": {k: abs(a[k] - b[k]) for k in keys[1:]}})


def describe(r: dict) -> str:
    """A check's metrics, for the log."""
    return (f"expected ppl ratio {r['expected_ppl_ratio']:.4f} (measured {r['ppl_ratio']:.4f}), "
            f"top-1 {r['top1_agreement']:.3f}")


def _metrics(result: dict) -> dict:
    return {k: result[k] for k in ("expected_ppl_ratio", "ppl_ratio", "top1_agreement")}


class SensitivitySearch:
    """Ranking and search over one switchable INT8 session (see the module docstring)."""

    def __init__(self, session, spec: ModelSpec, order: list[str], gate_windows: np.ndarray,
                 max_ratio: float, min_top1: float, corrected: list[str] | None = None,
                 reference: Callable[[np.ndarray], np.ndarray] | None = None, candidates: list[str] | None = None,
                 nudge: bool = True, labels: tuple[str, str] = ("INT8", "in float")):
        """``corrected``: the linears the graph has a bias correction for (its ``bias_mask`` input).
        ``reference``: the gate's logits to match [default: the switchable graph's, every linear
        kept]; ``candidates``: the linears ranked and kept [default: ``order``]; ``nudge``: whether
        a plan is also judged under its activation scales nudged (a graph without any: no);
        ``labels``: the log's words for a linear quantized and kept."""
        self.session, self.spec, self.order = session, spec, order
        self.candidates, self.nudge, self.labels = list(candidates or order), nudge, labels
        self.corrected = list(corrected or [])
        self.bias_on = np.zeros(len(order), np.float32)  # the corrections in use (``choose_corrections``)
        self.report: dict = {}
        self.checked: dict[tuple, dict] = {}  # (linears kept, corrections in use, nudge) -> that plan's check

        def run(mask: np.ndarray, nudge: float = 1.0) -> Callable[[np.ndarray], np.ndarray]:
            def fn(w: np.ndarray) -> np.ndarray:
                feeds = prefill_feeds(spec, w, "float32", all_logits=True)
                feeds["quant_mask"], feeds["scale_nudge"] = mask, np.array(nudge, np.float32)
                if self.corrected:
                    feeds["bias_mask"] = self.bias_on
                return session.run(["logits"], feeds)[0]
            return fn

        self._run = run
        self.gate = Gate(gate_windows, max_ratio, min_top1, reference or run(np.zeros(len(order), np.float32)))
        self.rank_windows = gate_windows[:RANK_WINDOWS, :RANK_SEQ_LEN]

    def check(self, keep: list[str]) -> dict:
        """The gate on the plan that keeps ``keep`` in float: under the activation scales as planned
        and, unless that verdict is clear (``Gate.clear``), under all of them ``NUDGE`` times larger
        too; then the mean of both, their verdict and ``spread``, how far each metric moved. A plan
        checked before (the search's first, every linear quantized, is the corrections' last) is
        not run again: the same session gives the same logits."""
        key = (tuple(sorted(keep)), self.bias_on.tobytes(), self.nudge)
        if key not in self.checked:
            a = self.gate.check(self._run(self.mask(keep)))
            if self.nudge and not self.gate.clear(a):
                a = self.gate.mean(a, self.gate.check(self._run(self.mask(keep), NUDGE)))
            self.checked[key] = a
        return copy.deepcopy(self.checked[key])

    def choose_corrections(self, log: Callable[[str], None]) -> list[str]:
        """The bias corrections to keep, kind by kind: each kind's are kept when, with every linear
        INT8, they lower the gate's expected perplexity ratio by more than ``MIN_GAIN`` without
        lowering its top-1 agreement by more than another rounding could."""
        if not self.corrected:
            return []
        best = off = self.check([])
        tried = {}
        for kind in sorted({kind_of(n) for n in self.corrected}):
            kept = self.bias_on.copy()
            self.bias_on = kept + self.mask_of([n for n in self.corrected if kind_of(n) == kind])
            r = tried[kind] = self.check([])
            better = (r["expected_ppl_ratio"] < best["expected_ppl_ratio"] - MIN_GAIN
                      and r["top1_agreement"] >= best["top1_agreement"] - CLEAR[1])
            log(f"  bias correction of {kind}: expected ppl ratio {best['expected_ppl_ratio']:.4f} -> "
                f"{r['expected_ppl_ratio']:.4f}, top-1 {best['top1_agreement']:.3f} -> {r['top1_agreement']:.3f} "
                f"({'kept' if better else 'dropped'})")
            if better:
                best = r
            else:
                self.bias_on = kept
        chosen = [n for n in self.order if self.bias_on[self.order.index(n)] > 0]
        self.report["bias_correction"] = {"off": _metrics(off), "on": _metrics(best),
                                          "by_kind": {k: _metrics(r) for k, r in tried.items()}, "kept": chosen}
        return chosen

    def mask_of(self, names: list[str]) -> np.ndarray:
        """1 at each named linear, 0 elsewhere."""
        return 1.0 - self.mask(names)

    def mask(self, keep_float: list[str]) -> np.ndarray:
        m = np.ones(len(self.order), np.float32)
        for n in keep_float:
            m[self.order.index(n)] = 0.0
        return m

    def rank(self, log: Callable[[str], None]) -> list[str]:
        ref = log_softmax(self._run(np.zeros(len(self.order), np.float32))(self.rank_windows), np.float32)
        p = np.exp(ref)

        def kl(mask: np.ndarray) -> float:
            lq = log_softmax(self._run(mask)(self.rank_windows), np.float32)
            return float(kl_rows(ref, lq, p).mean())

        progress, alone = Progress(len(self.candidates), "ranking linears"), {}
        for n in self.candidates:
            alone[n] = kl(self.mask_of([n]))
            progress.update()
        ranked = sorted(self.candidates, key=lambda n: (-float(f"{alone[n]:.3g}"), n))
        log(f"  sensitivity (KL with only that linear {self.labels[0]}): "
            + ", ".join(f"{n} {alone[n]:.5f}" for n in ranked[:6]) + ", ...")
        self.report.update({"kl_all_quantized": kl(self.mask([])), "kl_alone": alone, "ranked": ranked})
        return ranked

    def ranked(self, log: Callable[[str], None]) -> list[str]:
        """The ranking (computed once)."""
        return self.report.get("ranked") or self.rank(log)

    def run(self, log: Callable[[str], None]) -> list[str] | None:
        first = self.check([])
        trials = [{"kept_linears": 0, **first}]
        log(f"  gate with every linear {self.labels[0]}: {describe(first)}")
        if first["passed"]:
            self.report["trials"] = trials
            return []
        ranked = self.rank(log)

        def passes(keep: list[str]) -> bool:
            if not keep:
                return False
            r = self.check(keep)
            trials.append({"kept_linears": len(keep), **r})
            log(f"  gate with {len(keep)} linears {self.labels[1]}: {describe(r)} -> {'pass' if r['passed'] else 'fail'}")
            return bool(r["passed"])

        chosen = fewest_float(ranked, passes, log, self.labels[1])
        self.report["trials"] = trials
        return chosen
