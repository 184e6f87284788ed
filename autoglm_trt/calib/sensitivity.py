"""Which linears to keep in float: a measured end-to-end ranking, and the fewest that meet the gate.

All of it runs on one "switchable" INT8 graph whose ``quant_mask`` input turns each linear's
Q/DQ on or off, so trying a plan is one forward pass, not a graph rebuild.

* Ranking: first by kind, end to end: the mean KL(float || INT8) of the logits on a few
  calibration windows with every linear INT8, and again with all linears of one kind (qkv,
  o_proj, gate_up, down) in float; the kind whose return to float lowers it most comes
  first. Within a kind, by ``output_error`` (the INT8 error of the linear's own output on real
  rows). (Leave-one-out over single linears was tried on SmolLM2 and ranked worse: single
  effects are small and noisy next to their sum.)
* Search: keep the top k in float with k = 0, 1, 2, 4, ... until the gate (perplexity ratio
  and top-1 agreement against the float graph on held-back calibration windows) holds, then
  bisect between the last failing and the first passing k.
* Stability: an INT8 graph turns a rounding difference in x (another BLAS, another instruction
  set) into a different integer wherever x / s lies near a rounding boundary, and the search
  stops where the gate only just holds. So every plan is judged under two roundings (the
  activation scales as planned, and nudged by ``NUDGE``) and passes only if it passes under both;
  the ranking's ties break by name.
* Bias correction: each linear's mean INT8 output error on the sampled rows, added to its
  output, kept for a kind of linear only where it improves the gate's metrics.

"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..graph.metrics import log_softmax, next_token_scores
from ..graph.names import kind_of
from ..graph.quant import act_scale, quantize_weight_per_channel
from ..graph.runner import prefill_feeds
from ..model.spec import ModelSpec

RANK_WINDOWS = 2
# the search's second rounding: every activation scale this much larger moves each quotient x / s
# by 4e-6 of itself, so those that near a rounding boundary cross it, as another BLAS's or
# instruction set's rounding of x would
NUDGE = 1.0 + 2.0**-18
RANK_SEQ_LEN = 128


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


def fewest_float(ranked: list[str], passes: Callable[[list[str]], bool], log: Callable[[str], None]) -> list[str] | None:
    """Smallest prefix of ``ranked`` to keep in float for which ``passes`` holds (None if none does)."""
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
    log(f"sensitivity: {hi} of {len(ranked)} linears kept in float")
    return ranked[:hi]


class Gate:
    """Perplexity ratio and top-1 agreement of a model against a float reference on fixed windows."""

    def __init__(self, logits: Callable[[np.ndarray], np.ndarray], windows: np.ndarray, max_ratio: float,
                 min_top1: float, ref_logits: Callable[[np.ndarray], np.ndarray], batch: int = 4):
        self.logits, self.windows, self.max_ratio, self.min_top1, self.batch = logits, windows, max_ratio, min_top1, batch
        self.ref_nll, self.ref_top = self._score(ref_logits)

    def _score(self, fn: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        nll, top = [], []
        for b in range(0, len(self.windows), self.batch):
            w = self.windows[b : b + self.batch]
            lp, w_nll = next_token_scores(fn(w), w, np.float32)
            nll.append(w_nll)
            top.append(lp.argmax(-1))
        return np.concatenate(nll), np.concatenate(top)

    def check(self, fn: Callable[[np.ndarray], np.ndarray]) -> dict:
        nll, top = self._score(fn)
        ppl, ref_ppl = float(np.exp(nll.mean())), float(np.exp(self.ref_nll.mean()))
        top1 = float((top == self.ref_top).mean())
        return {"ppl": ppl, "ref_ppl": ref_ppl, "ppl_ratio": ppl / ref_ppl, "top1_agreement": top1,
                "passed": ppl / ref_ppl <= self.max_ratio and top1 >= self.min_top1}

    def check_graph(self) -> dict:
        return self.check(self.logits)


def _metrics(result: dict) -> dict:
    return {k: result[k] for k in ("ppl_ratio", "top1_agreement")}


class SensitivitySearch:
    """Ranking and search over one switchable INT8 session (see the module docstring)."""

    def __init__(self, session, spec: ModelSpec, order: list[str], gate_windows: np.ndarray,
                 max_ratio: float, min_top1: float, corrected: list[str] | None = None):
        """``corrected``: the linears the graph has a bias correction for (its ``bias_mask`` input)."""
        self.session, self.spec, self.order = session, spec, order
        self.corrected = list(corrected or [])
        self.bias_on = np.zeros(len(order), np.float32)  # the corrections in use (``choose_corrections``)
        self.report: dict = {}

        def run(mask: np.ndarray, nudge: float = 1.0) -> Callable[[np.ndarray], np.ndarray]:
            def fn(w: np.ndarray) -> np.ndarray:
                feeds = prefill_feeds(spec, w, "float32", all_logits=True)
                feeds["quant_mask"], feeds["scale_nudge"] = mask, np.array(nudge, np.float32)
                if self.corrected:
                    feeds["bias_mask"] = self.bias_on
                return session.run(["logits"], feeds)[0]
            return fn

        self._run = run
        self.gate = Gate(run(self.mask([])), gate_windows, max_ratio, min_top1, run(np.zeros(len(order), np.float32)))
        self.rank_windows = gate_windows[:RANK_WINDOWS, :RANK_SEQ_LEN]

    def check(self, keep: list[str]) -> dict:
        """The gate on the plan that keeps ``keep`` in float, passed only where it passes under two
        roundings (the activation scales as planned, and all of them ``NUDGE`` times larger; the
        second is run only when the first passes): then the worse of each metric, and ``spread``,
        how far each moved between them."""
        a = self.gate.check(self._run(self.mask(keep)))
        if not a["passed"]:
            return a
        b = self.gate.check(self._run(self.mask(keep), NUDGE))
        return {**a, "ppl": max(a["ppl"], b["ppl"]), "ppl_ratio": max(a["ppl_ratio"], b["ppl_ratio"]),
                "top1_agreement": min(a["top1_agreement"], b["top1_agreement"]), "passed": b["passed"],
                "spread": {"ppl_ratio": abs(a["ppl_ratio"] - b["ppl_ratio"]),
                           "top1_agreement": abs(a["top1_agreement"] - b["top1_agreement"])}}

    def choose_corrections(self, log: Callable[[str], None]) -> list[str]:
        """The bias corrections to keep, kind by kind: each kind's are kept when, with every linear
        INT8, they lower the gate's perplexity ratio without lowering its top-1 agreement."""
        if not self.corrected:
            return []
        best = off = self.gate.check(self._run(self.mask([])))
        tried = {}
        for kind in sorted({kind_of(n) for n in self.corrected}):
            kept = self.bias_on.copy()
            self.bias_on = kept + self.mask_of([n for n in self.corrected if kind_of(n) == kind])
            r = tried[kind] = self.gate.check(self._run(self.mask([])))
            better = r["ppl_ratio"] < best["ppl_ratio"] and r["top1_agreement"] >= best["top1_agreement"]
            log(f"  bias correction of {kind}: ppl ratio {best['ppl_ratio']:.4f} -> {r['ppl_ratio']:.4f}, top-1 "
                f"{best['top1_agreement']:.3f} -> {r['top1_agreement']:.3f} ({'kept' if better else 'dropped'})")
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

    def rank(self, errors: dict[str, float], log: Callable[[str], None]) -> list[str]:
        ref = log_softmax(self._run(np.zeros(len(self.order), np.float32))(self.rank_windows), np.float32)
        p = np.exp(ref)

        def kl(keep: list[str]) -> float:
            lq = log_softmax(self._run(self.mask(keep))(self.rank_windows), np.float32)
            return float((p * (ref - lq)).sum(-1).mean())

        base = kl([])
        kinds = sorted({kind_of(n) for n in self.order})
        gains = {k: base - kl([n for n in self.order if kind_of(n) == k]) for k in kinds}
        kinds.sort(key=lambda k: -gains[k])
        log("  sensitivity by kind (KL gain with all of a kind in float): "
            + ", ".join(f"{k} {gains[k]:.4f}" for k in kinds))
        ranked = [n for k in kinds for n in sorted((n for n in self.order if kind_of(n) == k),
                                                   key=lambda n: (-float(f"{errors[n]:.4g}"), n))]
        self.report.update({"kl_all_int8": base, "kl_gain_by_kind": gains, "ranked": ranked})
        return ranked

    def ranked(self, errors: dict[str, float], log: Callable[[str], None]) -> list[str]:
        """The ranking (computed once)."""
        return self.report.get("ranked") or self.rank(errors, log)

    def run(self, errors: dict[str, float], log: Callable[[str], None]) -> list[str] | None:
        first = self.check([])
        trials = [{"float_linears": 0, **first}]
        log(f"  gate with every linear INT8: ppl ratio {first['ppl_ratio']:.4f}, top-1 {first['top1_agreement']:.3f}")
        if first["passed"]:
            self.report["trials"] = trials
            return []
        ranked = self.rank(errors, log)

        def passes(keep: list[str]) -> bool:
            if not keep:
                return False
            r = self.check(keep)
            trials.append({"float_linears": len(keep), **r})
            log(f"  gate with {len(keep)} linears in float: ppl ratio {r['ppl_ratio']:.4f}, "
                f"top-1 {r['top1_agreement']:.3f} -> {'pass' if r['passed'] else 'fail'}")
            return bool(r["passed"])

        chosen = fewest_float(ranked, passes, log)
        self.report["trials"] = trials
        return chosen
