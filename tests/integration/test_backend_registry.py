"""A backend is one object registered by name: its traits steer the build, its methods build, check,
run and describe its engines, and nothing else in the package names it.

The fake backend here builds the ONNX Runtime engine's files under its own manifest section and runs
them with ONNX Runtime's runner; its traits differ from ONNX Runtime's (INT4 blocks of 16 only, no
int8-dyn, no per-token KV scales), which the build must obey without knowing its name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autoglm_trt.artifacts import EngineError, Manifest
from autoglm_trt.backends import registry
from autoglm_trt.backends.onnxrt.backend import OnnxRuntimeBackend
from autoglm_trt.errors import AutoGLMError
from autoglm_trt.record_schema import OrtGraphs, typed


class FakeBackend(OnnxRuntimeBackend):
    name, label = "fake", "Fake"
    traits = replace(OnnxRuntimeBackend.traits, int4_block=16, int4_blocks=(16,), dynamic_int8=False,
                     token_kv_scales=False, auto_rank=9)

    def __init__(self) -> None:
        self.runners: list = []

    def finish(self, out_dir, record, kv_dtype, eight_bit_activations, dynamic_int8, report, log):
        made = super().finish(out_dir, record, kv_dtype, eight_bit_activations, dynamic_int8, report, log)
        made[self.name]["fake"] = True  # the section is named after the backend
        return made

    def open_runner(self, manifest, num_blocks, threads, spinning):
        from autoglm_trt.backends.onnxrt.runner import OrtRunner

        kv = manifest.kv
        graphs = typed(OrtGraphs, manifest.section(self.name), manifest.dir / "manifest.json", EngineError,
                       "rebuild the engine", f"{self.name}.")
        runner = OrtRunner(manifest.dir, graphs, manifest.spec, num_blocks, kv.block_size, kv.dtype,
                           threads, spinning=spinning)
        self.runners.append(runner)
        return runner

    def findings(self, manifest):
        return [f"fake backend: section {sorted(manifest.data[self.name])[:2]}"]

    def inspect(self, manifest, report):
        return {"fake": True}, ["fake         its own lines"]

    def graph_runner(self, manifest, threads):
        return None


def _section(section: dict, engine_dir: Path, path: Path) -> None:
    if section.get("fake") is not True:
        raise AutoGLMError(f"{path}: the fake section must say fake: true")


def build(tiny_dir, out: Path, precision: str = "fp32", int4_block: int | None = None, **config) -> Path:
    """The tiny Llama built for the fake backend."""
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine

    settings = {"max_batch_size": 8, "max_input_len": 48, "max_seq_len": 96, "kv_num_blocks": 64, "kv_block_size": 8,
                **config}
    build_engine(BuildRequest(tiny_dir("llama"), out, precision=precision, backend="fake", int4_block=int4_block,
                              config=BuildConfig(**settings), cache_dir=out.parent / ".cache"), log=lambda m: None)
    return out


@pytest.fixture
def fake():
    backend = FakeBackend()
    registry.register(backend, _section)
    yield backend
    registry.unregister(backend.name)


def test_a_registered_backend_builds_loads_and_runs_its_engines(fake, tiny_dir, tiny_engine, tmp_path):
    from autoglm_trt.runtime import Engine, SamplingParams

    engine = build(tiny_dir, tmp_path / "fake")
    manifest = Manifest.read(engine)
    assert manifest.backend == "fake" and manifest.data["fake"]["fake"] is True and "onnxruntime" not in manifest.data
    params = SamplingParams(max_new_tokens=12)
    with Engine.load(engine) as ours, Engine.load(tiny_engine) as ort:
        assert ours.generate(["The cat"], params)[0].token_ids == ort.generate(["The cat"], params)[0].token_ids
    assert len(fake.runners) == 1  # the fake's runner ran it
    with pytest.raises(AutoGLMError, match="backend must be one of"):
        registry.unregister("fake")
        Manifest.read(engine)


def test_the_build_obeys_a_backends_traits_not_its_name(fake, tiny_dir, tmp_path):
    with pytest.raises(AutoGLMError, match="int8-dyn .* runs on ONNX Runtime's engine only; for Fake build another"):
        build(tiny_dir, tmp_path / "dyn", precision="int8-dyn")
    with pytest.raises(AutoGLMError, match="Fake builds INT4 weights in blocks of 16 inputs, not 32"):
        build(tiny_dir, tmp_path / "int4", precision="int4-awq", int4_block=32)
    with pytest.raises(AutoGLMError, match="per-token KV scales .* run on the onnxruntime backend; for Fake"):
        build(tiny_dir, tmp_path / "kv", kv_cache_dtype="int8", kv_scales="token")
    assert not any(tmp_path.iterdir())  # refused before any work


def test_auto_passes_over_a_backend_that_does_not_build_the_precision(fake):
    said: list[str] = []
    fast = replace(fake.traits, auto_rank=-1)
    fake.traits = fast  # first in auto's order now
    try:
        from autoglm_trt.precisions import precision

        assert registry.choose("auto", said.append, precision("int8-dyn")).name == "onnxruntime"
        assert "int8-dyn does not run on fake" in said[-1]
        assert registry.choose("auto", said.append, precision("fp32")).name == "fake"
    finally:
        del fake.traits


def test_doctor_and_inspect_ask_the_backend(fake, tiny_dir, tmp_path):
    from click.testing import CliRunner

    from autoglm_trt.cli import cli

    engine = build(tiny_dir, tmp_path / "fake")
    doctor = CliRunner().invoke(cli, ["doctor", str(engine)])
    assert doctor.exit_code == 0, doctor.output
    assert "info     fake backend: section ['attention', 'attention_why']" in doctor.output
    assert "fake fp32 engine is ready to run here" in doctor.output
    inspect = CliRunner().invoke(cli, ["inspect", str(engine)])
    assert inspect.exit_code == 0 and "fake         its own lines" in inspect.output
    assert "fusions      nodes" in inspect.output  # its build report read as ONNX Runtime's (it inherits that)
