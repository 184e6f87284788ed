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
