"""GLM-4.1V's per-grid encoder inputs (patch coordinates, resampled position embedding, 2-D rope)
against transformers' own modules."""

from __future__ import annotations

import numpy as np
import pytest

from autoglm_trt.model.vision import patch_coords, resampled_positions, rope_tables


@pytest.fixture(scope="module")
def visual():
    torch = pytest.importorskip("torch")
    from transformers import Glm4vVisionConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    torch.manual_seed(0)
    config = Glm4vVisionConfig(depth=1, hidden_size=48, intermediate_size=64, num_heads=3, out_hidden_size=32,
                               spatial_merge_size=2, patch_size=14, temporal_patch_size=2, image_size=98)
    model = Glm4vVisionModel(config).eval()
    with torch.no_grad():
        model.embeddings.position_embedding.weight.normal_()
    return torch, model


def _positions(torch, model, h: int, w: int):
    from transformers.vision_utils import get_vision_position_ids

    return get_vision_position_ids(torch.tensor([[1, h, w]]), model.spatial_merge_size)


@pytest.mark.parametrize("h,w", [(4, 6), (10, 2), (14, 14), (22, 8), (2, 30)])
def test_patch_coordinates_and_rope_equal_transformers(visual, h, w):
    torch, model = visual
    pos = _positions(torch, model, h, w)
    rows, cols = patch_coords(h, w, 2)
    np.testing.assert_array_equal(np.stack([rows, cols], 1), pos.numpy())
    with torch.no_grad():
        cos, sin = model.rotary_pos_emb(torch.zeros(1), pos)
    head_dim = model.config.hidden_size // model.config.num_heads
    our_cos, our_sin = rope_tables(head_dim, model.config.rope_parameters["rope_theta"], h, w, 2)
    np.testing.assert_allclose(our_cos, cos.numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(our_sin, sin.numpy(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("h,w", [(4, 6), (10, 2), (14, 14), (22, 8), (2, 30), (40, 18)])
def test_the_position_embedding_resampled_as_transformers_does(visual, h, w):
    """Smaller, equal and larger grids than the table's 7 x 7, odd aspect ratios (border taps)."""
    torch, model = visual
    pos = _positions(torch, model, h, w)
    n = h * w
    with torch.no_grad():
        want = model.embeddings(torch.zeros(n, model.config.hidden_size), torch.tensor([n]), torch.tensor([[1, h, w]]),
                                pos[:, 0], pos[:, 1])
    table = model.embeddings.position_embedding.weight.detach().numpy()
    np.testing.assert_allclose(resampled_positions(table, h, w, 2), want.numpy(), atol=1e-5, rtol=0)  # float32 taps there


def test_half_scalars_round_to_nearest_as_torch_does():
    """The TensorRT vision form's scale constant in each type: float32's value rounded to nearest,
    ties to even (the attention's ``head_dim ** -0.5`` for every head size, and values that round)."""
    import torch
    from onnx import TensorProto, numpy_helper

    from autoglm_trt.graph.vision_trt import scalar

    types = {TensorProto.BFLOAT16: torch.bfloat16, TensorProto.FLOAT16: torch.float16, TensorProto.FLOAT: torch.float32}
    for value in [d ** -0.5 for d in (16, 64, 72, 80, 128)] + [1 / 3, 1 + 2 ** -8, 1 + 3 * 2 ** -9, 3.14159]:
        for elem_type, dtype in types.items():
            got = numpy_helper.to_array(scalar("s", value, elem_type)).astype(np.float32)
            assert got == torch.tensor(value, dtype=torch.float32).to(dtype).float().item(), (value, elem_type)
