"""An engine whose head size the native PrefillAttention takes (64): its prefill branch is one
PrefillAttention node a layer, and its answers are the plain graph's to float32's rounding, for a
prompt in one step and for chunks after a past in the paged pool, with a float32 or an INT8 KV
cache."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import build_tiny_engine

from autoglm_trt.backends.onnxrt.passes.common import all_nodes


@pytest.fixture(scope="module", params=["float32", "int8"])
def hd64_engine(tmp_path_factory, library, request):
    """The tiny GLM-4 with heads of 64, as an fp32 engine with a ``request.param`` KV cache."""
    from tiny_models import make_tiny_checkpoint

    from autoglm_trt.native import float_kernel

    if float_kernel(library) == "portable C":
        pytest.skip("PrefillAttention needs fused multiply-add; this machine's build has none")
    root = tmp_path_factory.mktemp("hd64")
    checkpoint = make_tiny_checkpoint("glm4", root / "glm4-hd64", head_dim=64)
    return build_tiny_engine(lambda family: checkpoint, root / "engine", kv_cache_dtype=request.param)


def test_the_prefill_branch_is_one_prefill_attention_a_layer(hd64_engine):
    from autoglm_trt.artifacts import Manifest

    ops = [n.op_type for n in all_nodes(onnx.load(str(hd64_engine / "model.native.onnx"),
                                                  load_external_data=False).graph)]
    assert ops.count("PrefillAttention") == 2 and ops.count("PagedAttention") + ops.count("PagedAttentionInt8KV") == 2
    assert "MaskedSoftmax" not in ops and "Softmax" not in ops  # no score tensor is left in either branch
    assert "fma" in Manifest.read(hd64_engine).ort_graphs.requires


@pytest.mark.parametrize("step_tokens", [None, 7])
def test_answers_equal_the_plain_graphs_to_rounding(hd64_engine, monkeypatch, step_tokens):
    """One 40-token prefill, or the same text 7 tokens a step (each chunk over its past)."""
    from autoglm_trt.evaluate.perplexity import model_logits

    windows = np.random.default_rng(5).integers(3, 250, (2, 40))
    native = model_logits(hd64_engine, step_tokens=step_tokens)(windows)
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "0")
    plain = model_logits(hd64_engine, step_tokens=step_tokens)(windows)
    assert np.abs(native - plain).max() > 0  # two graphs ran
    assert np.abs(native - plain).max() <= 1e-4 * np.abs(plain).max(), np.abs(native - plain).max()
    assert (native.argmax(-1) == plain.argmax(-1)).all()


def test_an_engine_with_8_bit_activations_prefills_in_bfloat16_where_amx_has_it(tmp_path_factory, library,
                                                                                   monkeypatch):
    """``int8-dyn`` (activations rounded to 8 bits per block anyway) gets PrefillAttentionBf16: where
    this CPU has AMX-BF16 its answers are as far from an fp32 engine's as the plain graph's (float32
    attention) are, within a tenth; elsewhere they are the plain graph's to float32's rounding;
    doctor says which."""
    from conftest import run_cli
    from tiny_models import make_tiny_checkpoint

    from autoglm_trt.evaluate.perplexity import model_logits
    from autoglm_trt.native import attention_bf16, float_kernel

    if float_kernel(library) == "portable C":
        pytest.skip("PrefillAttention needs fused multiply-add; this machine's build has none")
    root = tmp_path_factory.mktemp("hd64-dyn")
    checkpoint = make_tiny_checkpoint("glm4", root / "glm4-hd64", head_dim=64)
    engine = build_tiny_engine(lambda family: checkpoint, root / "engine", precision="int8-dyn")
    fp32 = build_tiny_engine(lambda family: checkpoint, root / "fp32")
    ops = [n.op_type for n in all_nodes(onnx.load(str(engine / "model.native.onnx"), load_external_data=False).graph)]
    assert ops.count("PrefillAttentionBf16") == 2 and "PrefillAttention" not in ops
    windows = np.random.default_rng(5).integers(3, 250, (2, 40))
    native, reference = model_logits(engine)(windows), model_logits(fp32)(windows)
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "0")
    plain = model_logits(engine)(windows)
    monkeypatch.delenv("AUTOGLM_TRT_NATIVE")
    rms = lambda a: float(np.sqrt(np.mean(a.astype(np.float64) ** 2)))  # noqa: E731
    bf16 = attention_bf16(library)
    if bf16:
        assert rms(native - reference) <= 1.1 * rms(plain - reference)
        assert rms(native - plain) > 0.2 * rms(plain - reference)  # (the bfloat16 path ran)
    else:
        assert rms(native - plain) <= 0.2 * rms(plain - reference)
    doctor = run_cli("doctor", str(engine))
    assert ("bfloat16 products on AMX" if bf16 else "float32 here") in doctor.stdout, doctor.stdout
