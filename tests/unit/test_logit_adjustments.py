"""Logit adjustments against their definitions, to exact values (float32 arithmetic)."""

from __future__ import annotations

import numpy as np
import pytest

from autoglm_trt.runtime.penalties import TokenCounts, adjust
from autoglm_trt.runtime.sampling import SamplingError, SamplingParams

LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 0.0], np.float32)


def counts(prompt: list[int], generated: list[int]) -> TokenCounts:
    c = TokenCounts(prompt)
    for t in generated:
        c.add(t)
    return c


def test_frequency_and_presence_penalties_are_openai_s_over_generated_tokens():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = adjust(LOGITS, p, counts([1, 2, 2], [3, 3, 0]), set())
    # token 3 generated twice: 3 - 2*0.5 - 0.25; token 0 once: 2 - 0.5 - 0.25; prompt tokens untouched
    np.testing.assert_array_equal(got, np.array([1.25, -1.0, 0.5, 1.75, -2.0, 0.0], np.float32))


def test_repetition_penalty_is_transformers_over_prompt_and_output():
    p = SamplingParams(repetition_penalty=2.0)
    got = adjust(LOGITS, p, counts([1, 2, 2], [3]), set())
    np.testing.assert_array_equal(got, np.array([2.0, -2.0, 0.25, 1.5, -2.0, 0.0], np.float32))


def test_logit_bias_then_min_tokens_mask():
    p = SamplingParams(logit_bias={4: 10.0, 5: -1.5}, min_tokens=2, max_new_tokens=4)
    got = adjust(LOGITS, p, counts([0], [1]), {3})  # one generated of at least two: token 3 (an end) masked
    np.testing.assert_array_equal(got, np.array([2.0, -1.0, 0.5, -np.inf, 8.0, -1.5], np.float32))
    assert adjust(LOGITS, p, counts([0], [1, 2]), {3})[3] == 3.0  # two generated: no mask
    assert not SamplingParams().adjusts_logits and p.adjusts_logits


def test_counts_are_kept_not_recounted_and_copied_apart():
    c = counts([5, 5, 1], [2, 2, 2, 4])
    assert c.counts == {2: 3, 4: 1} and c.generated == 4
    twin = c.copy()
    twin.add(4)
    assert c.counts[4] == 1 and twin.counts[4] == 2
    assert sorted(c.seen().tolist()) == [1, 2, 4, 5]  # the prompt's and the text's distinct tokens
    c.add(9)
    c.add(1)
    twin.add(7)
    assert sorted(c.seen().tolist()) == [1, 2, 4, 5, 9] and sorted(twin.seen().tolist()) == [1, 2, 4, 5, 7]


@pytest.mark.parametrize("fields, message", [
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in"),
    ({"presence_penalty": float("nan")}, "presence_penalty must be a finite number"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ({"min_tokens": 9, "max_new_tokens": 8}, "exceeds max_new_tokens"),
    ({"logit_bias": {3: 101}}, "logit_bias values"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias token id"),
    ({"logit_bias": [1, 2]}, "logit_bias must be a mapping"),
    ({"stop_token_ids": [1, "x"]}, "stop token id"),
    ({"beam_width": 2, "repetition_penalty": 1.2}, "not supported with it"),
])
def test_bad_values_are_refused_when_made(fields, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**fields)
