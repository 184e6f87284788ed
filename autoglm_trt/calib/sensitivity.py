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


class SensitivitySearch:
    """Ranking and search over one switchable INT8 session (see the module docstring)."""

    def __init__(self, session, spec: ModelSpec, order: list[str], gate_windows: np.ndarray,
                 max_ratio: float, min_top1: float):
        self.session, self.spec, self.order = session, spec, order
        self.report: dict = {}

        def run(mask: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
            def fn(w: np.ndarray) -> np.ndarray:
                feeds = prefill_feeds(spec, w, "float32", all_logits=True)
                feeds["quant_mask"] = mask
                return session.run(["logits"], feeds)[0]
            return fn

        self._run = run
        self.gate = Gate(run(self.mask([])), gate_windows, max_ratio, min_top1, run(np.zeros(len(order), np.float32)))
        self.rank_windows = gate_windows[:RANK_WINDOWS, :RANK_SEQ_LEN]

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
        ranked = [n for k in kinds for n in sorted((n for n in self.order if kind_of(n) == k), key=lambda n: -errors[n])]
        self.report.update({"kl_all_int8": base, "kl_gain_by_kind": gains, "ranked": ranked})
        return ranked

    def ranked(self, errors: dict[str, float], log: Callable[[str], None]) -> list[str]:
        """The ranking (computed once)."""
        return self.report.get("ranked") or self.rank(errors, log)

    def run(self, errors: dict[str, float], log: Callable[[str], None]) -> list[str] | None:
        first = self.gate.check(self._run(self.mask([])))
        trials = [{"float_linears": 0, **first}]
        log(f"  gate with every linear INT8: ppl ratio {first['ppl_ratio']:.4f}, top-1 {first['top1_agreement']:.3f}")
        if first["passed"]:
            self.report["trials"] = trials
            return []
        ranked = self.rank(errors, log)

        def passes(keep: list[str]) -> bool:
            if not keep:
                return False
            r = self.gate.check(self._run(self.mask(keep)))
            trials.append({"float_linears": len(keep), **r})
            log(f"  gate with {len(keep)} linears in float: ppl ratio {r['ppl_ratio']:.4f}, "
                f"top-1 {r['top1_agreement']:.3f} -> {'pass' if r['passed'] else 'fail'}")
            return bool(r["passed"])

        chosen = fewest_float(ranked, passes, log)
        self.report["trials"] = trials
        return chosen
