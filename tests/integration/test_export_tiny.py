"""Export of tiny random GLM, GLM-4 and Llama checkpoints: parity with transformers."""

import json
from collections import Counter

import numpy as np
import onnx
import pytest

from autoglm_trt.backends.onnxrt.session import make_session
from autoglm_trt.errors import ValidationError
from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint
from autoglm_trt.export.validate import paged_decode_logits, reference_logits
from autoglm_trt.model import spec as arch
from autoglm_trt.model.spec import spec_from_config

FAMILIES = ["llama", "glm", "glm4", "glm4v"]


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    out = {}
    for fam in FAMILIES:
        for dtype in ("float32", "float16"):
            d = tmp_path_factory.mktemp(f"exp-{fam}-{dtype}") / "out"
            export_checkpoint(ExportConfig(tiny_dir(fam), d, dtype=dtype), log=lambda m: None)
            out[fam, dtype] = d
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_parity_within_1e3_and_argmax_everywhere(exported, family):
    report = json.loads((exported[family, "float32"] / "export.json").read_text())["parity"]
    assert report["passed"]
    assert report["max_abs_diff"] <= 1e-3
    for path in ("prefill", "decode"):
        assert report[path]["argmax_agree"] == report[path]["positions"]
    assert report["decode"]["positions"] == sum(report["prompt_lengths"])


@pytest.mark.parametrize("family", FAMILIES)
def test_independent_parity_on_other_prompts(exported, tiny_dir, family):
    """Not trusting the export's own report: other prompts, compared here."""
    ckpt = tiny_dir(family)
    spec = spec_from_config(json.loads((ckpt / "config.json").read_text()))
    rng = np.random.default_rng(123)
    prompts = [rng.integers(0, spec.vocab_size, n).tolist() for n in (1, 16, 33, 50)]
    ref = reference_logits(ckpt, prompts)
    got = paged_decode_logits(make_session(exported[family, "float32"] / "model.onnx"), spec, prompts, "float32")
    for r, g in zip(ref, got):
        assert np.max(np.abs(r - g)) <= 1e-3
        assert (r.argmax(-1) == g.argmax(-1)).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_float16_export_is_close(exported, family):
    report = json.loads((exported[family, "float16"] / "export.json").read_text())["parity"]
    assert report["passed"] and report["max_abs_diff"] <= 5e-2
    model = onnx.load(str(exported[family, "float16"] / "model.onnx"), load_external_data=False)
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert types["past_key.0"] == onnx.TensorProto.FLOAT16
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # logits stay float32


@pytest.mark.parametrize("family", FAMILIES)
def test_one_gemm_each_for_qkv_and_gate_up(exported, tiny_dir, family):
    d = exported[family, "float32"]
    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    weights = {t.name for t in model.graph.initializer}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    names = Counter(n.input[1].split(".")[-2] if n.input[1].endswith(".weight") else n.input[1] for n in matmuls)
    layers = json.loads((d / "export.json").read_text())["spec"]["num_layers"]
    # and one rope MatMul (by the signed permutation) for q and k together
    assert names == {"qkv": layers, "o_proj": layers, "gate_up": layers, "down": layers, "rotate_half": layers}
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer
               if t.name.endswith(".weight"))


def test_export_json_records_spec_io_and_hashes(exported, tiny_dir):
    meta = json.loads((exported["glm", "float32"] / "export.json").read_text())
    assert meta["spec"]["family"] == "glm" and meta["spec"]["rope"]["rotary_dim"] == 8
    assert meta["graph"]["inputs"][:6] == ["input_ids", "position_ids", "context_lens", "query_lens", "block_tables",
                                           "logits_indices"]
    assert "new_value.1" in meta["graph"]["outputs"]
    assert set(meta["source"]["sha256"]) == {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"}
    assert all(len(h) == 64 for h in meta["source"]["sha256"].values())
    assert meta["versions"]["onnxruntime"]


def test_validation_catches_a_wrong_graph(tiny_dir, tmp_path, monkeypatch):
    """Exporting GLM as if its rope were half-split must fail the parity gate and leave nothing."""
    broken = arch.Family("glm", ("GlmForCausalLM",), rope_interleaved=False, gate_up_fused=True,
                         sandwich_norms=False, default_partial_rotary=0.5)
    monkeypatch.setitem(arch.FAMILIES, "glm", broken)
    with pytest.raises(ValidationError, match="does not match transformers"):
        export_checkpoint(ExportConfig(tiny_dir("glm"), tmp_path / "out"), log=lambda m: None)
    assert list(tmp_path.iterdir()) == []


def test_mrope_positions_of_an_image_layout_match_transformers(exported, tiny_dir):
    """GLM-4.1V's 3-D positions (two images' grids among text, rows that differ), prefilled in two
    chunks through the paged pool and then decoded past the prompt (position + delta): logits as
    transformers gives them for the same tokens and positions."""
    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.backends.onnxrt.session import make_session, run
    from autoglm_trt.kvcache.host_pools import KVPools
    from autoglm_trt.kvcache.step_inputs import MRope, SeqState, StepImages, step_inputs
    from autoglm_trt.model.multimodal import ImageSpan, mrope_positions
    from autoglm_trt.model.reference import hf_logits

    export = exported["glm4v", "float32"]
    spec = ExportRecord.read(export).spec
    n = 40
    spans = [ImageSpan(3, 11, (1, 4, 8), b"a" * 16), ImageSpan(20, 26, (1, 6, 4), b"b" * 16)]
    positions, delta = mrope_positions(n, spans, merge=2)
    assert delta < 0 and len({tuple(r) for r in positions.T}) == n  # rows differ: a real 3-D layout
    ids = np.random.default_rng(3).integers(3, 250, n)
    decode_positions = positions[:, -1:] + 1 + np.arange(4)[None]  # the generated tokens' (row-equal)
    want = hf_logits(tiny_dir("glm4v"))(np.concatenate([ids, ids[:4]])[None],
                                         np.concatenate([positions, decode_positions], axis=1)[:, None, :])[0]
    session = make_session(export / "model.onnx")
    pools = KVPools(spec.num_layers, 8, 8, spec.num_kv_heads, spec.head_dim)
    state, mrope, got = SeqState(0, list(range(8))), MRope(positions, delta), []
    for chunk in (ids[:25].tolist(), ids[25:].tolist(), *([[int(t)] for t in ids[:4]])):
        feeds, slots = step_inputs([chunk], [state], 8, all_logits=True, mrope=[mrope],
                                   images=StepImages.text(spec.hidden_size, 1))
        assert feeds["position_ids"].shape == (3, 1, len(chunk))
        out = run(session, {**feeds, **pools.feeds()})
        pools.write(out, slots)
        got.append(out["logits"][0, : len(chunk)])
        state.num_computed_tokens += len(chunk)
    got = np.concatenate(got)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    flat = np.arange(n + 4)  # the same tokens at 1-D positions: the 3-D layout must make a difference
    other = hf_logits(tiny_dir("glm4v"))(np.concatenate([ids, ids[:4]])[None], np.stack([flat] * 3)[:, None, :])[0]
    assert np.abs(other - want).max() > 20 * np.abs(got - want).max()
