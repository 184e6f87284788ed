"""Penalties in the engine: greedy with ``repetition_penalty`` token for token transformers'
``generate``; OpenAI's frequency and presence penalties equal a reference loop over
transformers' logits; ``min_tokens``, ``logit_bias`` and ``stop_token_ids`` end where they say."""

from __future__ import annotations

import numpy as np
import pytest

from autoglm_trt.runtime import Engine, SamplingParams

PROMPTS = [np.random.default_rng(k).integers(3, 250, n).tolist() for k, n in ((0, 7), (1, 20), (2, 12))]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir("llama")), dtype=torch.float32).eval()
    return torch, model


def test_greedy_repetition_penalty_equals_transformers(tiny_engine, reference):
    torch, model = reference
    with Engine.load(tiny_engine) as engine:
        got = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, repetition_penalty=1.3, ignore_eos=True))
        plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert any(a.token_ids != b.token_ids for a, b in zip(got, plain))  # the penalty changes the answers
    for prompt, res in zip(PROMPTS, got):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.3,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert res.token_ids == want


def test_frequency_and_presence_penalties_follow_their_definition(tiny_engine, reference):
    """The engine's greedy tokens under OpenAI's penalties equal a loop that applies them to
    transformers' logits; and they differ from the unpenalized tokens (the penalties act)."""
    torch, model = reference
    params = SamplingParams(max_new_tokens=16, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True)
    with Engine.load(tiny_engine) as engine:
        got = engine.generate(PROMPTS, params)
        plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for prompt, res in zip(PROMPTS, got):
        ids, counts = list(prompt), {}
        for _ in range(16):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].numpy().astype(np.float32)
            for t, c in counts.items():
                logits[t] -= np.float32(1.5) * c + np.float32(0.5)
            token = int(np.argmax(logits))
            counts[token] = counts.get(token, 0) + 1
            ids.append(token)
        assert res.token_ids == ids[len(prompt):]
    assert any(a.token_ids != b.token_ids for a, b in zip(got, plain))


def test_min_tokens_logit_bias_and_stop_token_ids(tiny_engine):
    with Engine.load(tiny_engine) as engine:
        eos = sorted(engine.eos)[0]
        forced = {eos: 100.0}  # EOS always wins, once allowed
        [early] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, logit_bias=forced))
        [late] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, logit_bias=forced, min_tokens=4))
        [stopped] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, logit_bias={77: 100.0},
                                                                 stop_token_ids=[77], ignore_eos=True))
        [biased] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=5, logit_bias={77: 100.0},
                                                                ignore_eos=True))
    assert early.token_ids == [] and early.finish_reason == "stop"
    assert len(late.token_ids) == 4 and late.finish_reason == "stop" and eos not in late.token_ids
    assert stopped.token_ids == [] and stopped.finish_reason == "stop"
    assert biased.token_ids == [77] * 5


def test_logprobs_are_log_softmax_of_the_logits_the_sampler_used(tiny_engine, reference):
    """Each generated token's log-probability and its top 3 (sorted) equal log_softmax of
    transformers' logits after the frequency penalty, the adjusted logits the sampler drew from."""
    torch, model = reference
    params = SamplingParams(max_new_tokens=6, frequency_penalty=0.7, logprobs=3, ignore_eos=True)
    with Engine.load(tiny_engine) as engine:
        [res] = engine.generate([PROMPTS[1]], params)
    [choice] = res.choices
    assert [e.token for e in choice.logprobs] == res.token_ids
    ids, counts = list(PROMPTS[1]), {}
    for entry in choice.logprobs:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].numpy().astype(np.float32)
        for t, c in counts.items():
            logits[t] -= np.float32(0.7) * c
        lp = torch.log_softmax(torch.from_numpy(logits.astype(np.float64)), -1).numpy()
        assert entry.logprob == pytest.approx(lp[entry.token], abs=1e-4)
        order = np.argsort(-lp, kind="stable")[:3]
        assert [t for t, _ in entry.top] == order.tolist()
        np.testing.assert_allclose([v for _, v in entry.top], lp[order], atol=1e-4)
        assert entry.top[0][0] == entry.token  # greedy: the sampled token is the most likely
        counts[entry.token] = counts.get(entry.token, 0) + 1
        ids.append(entry.token)
