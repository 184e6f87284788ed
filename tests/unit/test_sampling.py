import numpy as np
import pytest

from autoglm_trt.runtime.sampling import SamplingError, SamplingParams, sample
from autoglm_trt.runtime.sequence import Sequence


def test_greedy_is_argmax():
    assert sample(np.array([0.1, 3.0, -1.0, 2.9]), SamplingParams(temperature=0.0), np.random.default_rng(0)) == 1


def test_top_k_1_is_argmax_at_any_temperature():
    logits = np.array([0.5, 0.2, 4.0, 1.0])
    rng = np.random.default_rng(0)
    assert {sample(logits, SamplingParams(temperature=5.0, top_k=1), rng) for _ in range(50)} == {2}


def test_top_p_keeps_the_smallest_nucleus():
    # probabilities 0.5, 0.3, 0.2 (after softmax of their logs); top_p 0.75 keeps the first two
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    rng = np.random.default_rng(0)
    draws = [sample(logits, SamplingParams(temperature=1.0, top_p=0.75), rng) for _ in range(400)]
    assert set(draws) == {0, 1}
    assert 0.55 < draws.count(0) / 400 < 0.70  # 0.5 / 0.8 = 0.625


def test_seeded_sampling_is_reproducible():
    """A request's generator comes from its seed: the same seed draws the same tokens, another seed others."""
    logits = np.random.default_rng(1).standard_normal(100)

    def draws(seed: int) -> list[int]:
        seq = Sequence([1], SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=seed))
        return [sample(logits, seq.params, seq.rng) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.mark.parametrize("kwargs, message", [
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": 1.5}, "top_p must be in"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"top_k": -1}, "top_k"),
    ({"stop": ("",)}, "stop strings"),
])
def test_bad_params(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kwargs)


def _full_sort(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """The sampler's distribution by its definition, in float64 over a full stable sort (as the
    sampler computed it before it stopped sorting the vocabulary): token -> probability."""
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < x.size:
        cut = np.partition(x, -top_k)[-top_k]
        x = np.where(x >= cut, x, -np.inf)
    order = np.argsort(-x, kind="stable")
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return {int(t): float(q) for t, q in zip(order, p) if q > 1e-12}


@pytest.mark.parametrize("vocab", [7, 3000, 49152])
@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 0, 0.5), (0.05, 0, 0.99), (1.0, 40, 1.0), (0.8, 40, 0.9), (2.0, 0, 0.99)])
def test_the_distribution_is_the_full_sorts(vocab, temperature, top_k, top_p):
    """Without sorting the vocabulary, the tokens and probabilities are those of the definition
    (a full sort in float64), for logits with ties and a long tail."""
    from autoglm_trt.runtime.sampling import distribution

    rng = np.random.default_rng(vocab + int(100 * temperature) + top_k)
    logits = (rng.standard_normal(vocab) * 4).astype(np.float32)
    logits[rng.choice(vocab, vocab // 3)] = logits[0]  # ties, some of them near the top
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ids, probs = distribution(logits, params)
    got = {int(t): float(q) for t, q in zip(ids, probs) if q > 1e-12}
    want = _full_sort(logits, temperature, top_k, top_p)
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[t] for t in want], list(want.values()), rtol=2e-5, atol=1e-12)
    assert abs(probs.sum() - 1.0) < 1e-9


@pytest.mark.parametrize("size", [5, 1024, 1025, 49152])
def test_draw_gives_each_index_its_share_of_the_uniform_range(size):
    """For u evenly over [0, 1), each index comes up in proportion to its weight (zeros never),
    through the block sums as within one block."""
    from autoglm_trt.runtime.sampling import draw

    rng = np.random.default_rng(size)
    weights = rng.random(size).astype(np.float32) * (rng.random(size) < 0.5)  # half of them zero
    weights[0] = weights[-1] = 0.0
    m = 30_000  # draws: index i gets the points u = (j + 0.5) / m in its share of [0, 1), within 2
    counts = np.bincount([draw(weights, (j + 0.5) / m) for j in range(m)], minlength=size)
    share = weights.astype(np.float64) / weights.sum(dtype=np.float64)
    assert not counts[weights == 0].any()
    np.testing.assert_allclose(counts / m, share, rtol=0, atol=2 / m)
