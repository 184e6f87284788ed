import numpy as np
import pytest

from autoglm_trt.runtime.sampling import SamplingError, SamplingParams, sample
from autoglm_trt.runtime.scheduler import Sequence


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
