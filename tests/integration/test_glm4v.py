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


@pytest.mark.parametrize("size", [(112, 84), (60, 200)])
def test_the_vision_encoder_graph_equals_transformers(tiny_dir, tmp_path, size):
    """One image through the exported encoder (host-side position embedding and rope for its grid)
    against transformers' Glm4vVisionModel: the merged image embeddings the decoder would take."""
    import torch
    import transformers
    from PIL import Image

    from autoglm_trt.graph.session import make_session
    from autoglm_trt.graph.vision import write_vision_graph
    from autoglm_trt.model.checkpoint import Checkpoint
    from autoglm_trt.model.image import ImageConfig, preprocess
    from autoglm_trt.model.vision import resampled_positions, rope_tables

    ckpt_dir = tiny_dir("glm4v")
    ckpt = Checkpoint.open(ckpt_dir)
    vcfg = ckpt.config["vision_config"]
    image = Image.fromarray(np.random.default_rng(size[0]).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    pixels, grids = preprocess([image], ImageConfig(patch_size=vcfg["patch_size"], merge_size=vcfg["spatial_merge_size"]))
    _, h, w = (int(x) for x in grids[0])
    head_dim = vcfg["hidden_size"] // vcfg["num_heads"]
    cos, sin = rope_tables(head_dim, vcfg.get("rope_parameters", {}).get("rope_theta", 10000.0), h, w, 2)
    table = ckpt.read("model.visual.embeddings.position_embedding.weight")
    session = make_session(write_vision_graph(ckpt, tmp_path))
    got = session.run(["image_embeds"], {"pixel_values": pixels, "pos_embed": resampled_positions(table, h, w, 2),
                                         "rope_cos": cos, "rope_sin": sin})[0]
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(ckpt_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids)).pooler_output.numpy()
    assert got.shape == want.shape == (h * w // 4, ckpt.config["text_config"]["hidden_size"])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
