"""GLM-4.1V (AutoGLM-Phone-9B's architecture) as an engine: text prompts so far, token for token
transformers' greedy generation, with and without the native operators."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import build_tiny_engine

from autoglm_trt.runtime import Engine, SamplingParams


@pytest.fixture(scope="module")
def glm4v_engine(tiny_dir, tmp_path_factory):
    return build_tiny_engine(tiny_dir, tmp_path_factory.mktemp("glm4v") / "engine", family="glm4v")


def _transformers_greedy(checkpoint, prompt: list[int], new: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("native", ["1", "0"])
def test_greedy_text_generation_equals_transformers(glm4v_engine, tiny_dir, monkeypatch, native):
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", native)
    prompts = [np.random.default_rng(k).integers(3, 250, n).tolist() for k, n in ((0, 9), (1, 30), (2, 3))]
    with Engine.load(glm4v_engine, prefix_caching=False) as engine:
        assert (engine.backend.attention == "native") == (native == "1")
        results = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _transformers_greedy(tiny_dir("glm4v"), prompt, 12)
