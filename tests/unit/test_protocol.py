"""The OpenAI shapes the server answers in, made from an engine's results (``serve/protocol.py``)."""

from __future__ import annotations

from autoglm_trt.runtime.request import TokenLogprob
from autoglm_trt.serve.protocol import completion_logprobs


def test_completion_logprobs_offsets_count_the_text_before_each_token():
    """Each token's offset is the length of the text before it (from the chunk's offset), in one
    pass over the tokens (a long answer's logprobs are made in time linear in its length)."""
    words = {1: "ab", 2: "c", 3: "déf", 4: ""}
    entries = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in (1, 2, 4, 3)]
    out = completion_logprobs(entries, words.__getitem__, offset=7)
    assert out["tokens"] == ["ab", "c", "", "déf"] and out["text_offset"] == [7, 9, 10, 10]
    assert completion_logprobs([], words.__getitem__, 3)["text_offset"] == []
    many = completion_logprobs([TokenLogprob(2, -1.0, [])] * 50_000, words.__getitem__)
    assert many["text_offset"][-1] == 49_999
