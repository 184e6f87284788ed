"""The TensorRT runner's host-side logic, on the CPU: buffer sizes, profile choice, error messages.
(The CUDA side runs in tests/gpu/test_cuda_runtime.py on a GPU; a TensorRT engine is not built here.)"""

import numpy as np
import pytest

from autoglm_trt.artifacts import EngineError
from autoglm_trt.backends.trt.runner import (
    DECODE_PROFILE,
    PREFILL_PROFILE,
    buffer_plan,
    check_row_alignment,
    profile_for,
    require,
)
from autoglm_trt.model.spec import spec_from_dict

SMOL = {"family": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
        "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope": {"theta": 1e5, "rotary_dim": 64, "rope_type": "default", "scaling": {}},
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_ids": [2]}


def test_logits_buffer_holds_one_row_per_sequence():
    """The graph returns [batch, 1, vocab] to the runtime: 16 x 49,152 floats (3 MB), not
    16 x 1,024 x 49,152 (3.2 GB) as before."""
    plan = buffer_plan(spec_from_dict(SMOL), max_batch=16, max_tokens=1024, max_seq_len=2048, block_size=16)
    shape, dtype = plan["logits"]
    assert shape == (16, 49152) and dtype == np.float32
    assert np.prod(shape) * dtype.itemsize == 3_145_728
    assert plan["block_tables"][0] == (16, 128) and plan["input_ids"][0] == (16, 1024)
    assert plan["logits_indices"][0] == (16, 1)


def test_profile_choice():
    assert profile_for(1) == DECODE_PROFILE and profile_for(2) == PREFILL_PROFILE == profile_for(1024)


def test_refused_calls_name_what_was_refused():
    require(True, "x")
    with pytest.raises(EngineError, match="TensorRT refused input input_ids of shape"):
        require(False, "input input_ids of shape (2, 4096): outside optimization profile 0 of this engine")


def test_row_alignment_for_the_scatter_kernel():
    check_row_alignment(64, np.dtype(np.float16))
    check_row_alignment(3, np.dtype(np.float32))
    with pytest.raises(EngineError, match="multiple of 4 bytes"):
        check_row_alignment(3, np.dtype(np.float16))


def test_a_vision_family_plans_its_image_inputs_and_a_vision_profile():
    """GLM-4.1V's decoder steps carry image rows (up to every new token + the zero row) and indices;
    its vision engine's profile spans one merged block to what max_pixels allows (a 1080 x 2400
    screenshot at 5,000,000 pixels is 12,432 patches, within the 12,755 that bound allows)."""
    from autoglm_trt.builder.profiles import vision_profile
    from autoglm_trt.model.vision import VisionSpec

    spec = spec_from_dict({**SMOL, "family": "glm4v", "mrope_section": [8, 12, 12]})
    plan = buffer_plan(spec, max_batch=4, max_tokens=256, max_seq_len=1024, block_size=16)
    assert plan["image_embeds"][0] == (1 + 4 * 256, 576) and plan["image_index"][0] == (4, 256)
    vision = VisionSpec(1536, 128, 10000.0, 2, 14, 2, 4096, 151343, 151339, 151340)
    [profile] = vision_profile(vision, 5_000_000).values()
    assert profile["pixel_values"] == ((4, 1176), (12755, 1176), (12755, 1176))
    assert profile["pos_embed"][2] == (12755, 1536) and profile["rope_cos"][0] == (4, 128)
    assert 12432 <= vision.max_patches(5_000_000)


def test_bfloat16_is_refused_before_ampere_with_what_to_set():
    from autoglm_trt.backends.trt.probe import bfloat16_refusal

    assert bfloat16_refusal(None) is None
    for capability in ("8.0", "8.9", "9.0", "10.0", "12.1"):
        assert bfloat16_refusal({"name": "GPU", "compute_capability": capability}) is None
    for capability in ("7.5", "7.0", "6.1"):
        message = bfloat16_refusal({"name": "Tesla T4", "compute_capability": capability})
        assert message is not None and "Tesla T4" in message and "vision_dtype float16" in message
