"""The calibration gate's metrics (``calib.sensitivity.Gate``) against float64 numpy, and its
verdicts: the expected perplexity ratio exp(mean KL) decides, each target loosened by a slack."""

import numpy as np
import pytest

from autoglm_trt.calib.sensitivity import CLEAR, Gate

VOCAB = 7


def lsm(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def fixed(seed: int, shape=(5, 9, VOCAB)) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, shape).astype(np.float32)


@pytest.fixture
def setup():
    windows = np.random.default_rng(3).integers(0, VOCAB, (5, 9))
    ref, model = fixed(1), fixed(1) + 0.3 * fixed(2)
    rows = {w.tobytes(): i for i, w in enumerate(windows)}

    def logits_of(table):
        return lambda w: np.stack([table[rows[r.tobytes()]] for r in w])

    return windows, logits_of(ref), logits_of(model), ref, model


def test_metrics_match_float64(setup):
    windows, ref_fn, model_fn, ref, model = setup
    gate = Gate(windows, 1.5, 0.5, ref_fn, batch=2)  # batches of 2, 2 and 1 window
    r = gate.check(model_fn)
    lp, lq = lsm(ref[:, :-1]), lsm(model[:, :-1])
    nxt = windows[:, 1:, None]
    nll_p, nll_q = -np.take_along_axis(lp, nxt, -1).mean(), -np.take_along_axis(lq, nxt, -1).mean()
    kl = (np.exp(lp) * (lp - lq)).sum(-1).mean()
    assert r["ppl"] == pytest.approx(np.exp(nll_q), rel=1e-5)
    assert r["ref_ppl"] == pytest.approx(np.exp(nll_p), rel=1e-5)
    assert r["ppl_ratio"] == pytest.approx(np.exp(nll_q - nll_p), rel=1e-5)
    assert r["kl"] == pytest.approx(kl, rel=1e-4) and kl > 0.01
    assert r["expected_ppl_ratio"] == pytest.approx(np.exp(kl), rel=1e-5)
    assert r["top1_agreement"] == pytest.approx((lp.argmax(-1) == lq.argmax(-1)).mean())
    same = gate.check(ref_fn)
    assert same["kl"] == pytest.approx(0, abs=1e-6) and same["top1_agreement"] == 1.0 and same["passed"]


def test_the_expected_ratio_decides_and_slack_loosens_it(setup):
    windows, ref_fn, model_fn, _, _ = setup
    r = Gate(windows, 1.0, 0.0, ref_fn).check(model_fn)
    exp_ratio, top1 = r["expected_ppl_ratio"], r["top1_agreement"]

    def verdict(max_ratio, min_top1, slack=(0.0, 0.0)):
        return Gate(windows, max_ratio, min_top1, ref_fn).check(model_fn, slack)["passed"]

    assert verdict(exp_ratio + 1e-4, top1) and not verdict(exp_ratio - 1e-4, top1)
    assert not verdict(exp_ratio + 1e-4, top1 + 0.05)
    assert verdict(exp_ratio - 1e-4, top1 + 0.05, (2e-4, 0.06))
    # the measured ratio does not decide: a bound between it and the expected one
    if r["ppl_ratio"] < exp_ratio:
        assert not verdict((r["ppl_ratio"] + exp_ratio) / 2, top1)


def test_clear_verdicts_and_the_mean_of_two_roundings(setup):
    windows, ref_fn, model_fn, _, _ = setup
    gate = Gate(windows, 1.1, 0.8, ref_fn)

    def result(ratio, top1):
        return gate._verdict({"ppl": 1.0, "ppl_ratio": ratio, "kl": float(np.log(ratio)), "expected_ppl_ratio": ratio,
                              "top1_agreement": top1})

    assert gate.clear(result(1.1 - 2 * CLEAR[0], 0.8 + 2 * CLEAR[1]))  # clearly passes
    assert gate.clear(result(1.1 + 2 * CLEAR[0], 0.99))  # clearly fails on the ratio
    assert gate.clear(result(1.1, 0.8 - 2 * CLEAR[1]))  # clearly fails on top-1
    assert not gate.clear(result(1.1 - CLEAR[0] / 2, 0.99))  # near the ratio's bound
    assert not gate.clear(result(1.0, 0.8 + CLEAR[1] / 2))  # near top-1's bound
    m = gate.mean(result(1.0998, 0.82), result(1.1004, 0.80))
    assert m["expected_ppl_ratio"] == pytest.approx(1.1001) and m["top1_agreement"] == pytest.approx(0.81)
    assert not m["passed"] and m["spread"]["expected_ppl_ratio"] == pytest.approx(6e-4)


class CountingSession:
    """A switchable session's stand-in: logits that move with each linear's ``quant_mask`` and
    ``bias_mask`` entry (and the scale nudge), and a count of runs."""

    def __init__(self, n_linears: int):
        self.runs = 0
        self.shift = np.random.default_rng(5).normal(0, 0.3, (2, n_linears, VOCAB)).astype(np.float32)

    def run(self, outputs, feeds):
        self.runs += 1
        w = feeds["input_ids"]
        base = fixed(1, (len(w), w.shape[1], VOCAB))
        move = feeds["quant_mask"] @ self.shift[0] + feeds["bias_mask"] @ self.shift[1]
        return [base + move * feeds["scale_nudge"]]


def test_a_plan_checked_before_is_not_run_again(monkeypatch):
    from autoglm_trt.calib import sensitivity

    monkeypatch.setattr(sensitivity, "prefill_feeds", lambda spec, w, dtype, all_logits: {"input_ids": w})
    order = ["a", "b", "c"]
    session = CountingSession(len(order))
    windows = np.random.default_rng(3).integers(0, VOCAB, (6, 9))
    search = sensitivity.SensitivitySearch(session, None, order, windows, 1.5, 0.5, corrected=["a", "c"])
    made = session.runs  # the reference's
    first = search.check([])
    ran = session.runs - made
    assert ran in (2, 4)  # two batches of windows, under one rounding or two
    assert search.check([]) == first and session.runs - made == ran
    before = session.runs
    kept = search.check(["b", "a"])
    assert session.runs > before and kept["kl"] != first["kl"]
    after = session.runs
    assert search.check(["a", "b"]) == kept and session.runs == after  # the same plan, named in another order
    search.bias_on = search.mask_of(["a"])  # another plan: other corrections in use
    corrected = search.check([])
    assert session.runs > after and corrected["kl"] != first["kl"]
    after = session.runs
    search.bias_on = np.zeros(len(order), np.float32)
    assert search.check([]) == first and session.runs == after
