"""TensorRT as a ``Backend``: on an NVIDIA GPU; its engine is a plan compiled from the graph
(``loader.build_plan``), run by ``TrtRunner`` with the KV pool on the device, fixed at build."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...artifacts import ExportRecord, Manifest
from ...record_schema import TensorRTBuild, made
from ..base import BackendTraits, EngineSettings, StepRunner


class TensorRTBackend:
    name, label = "tensorrt", "TensorRT"
    # NvInfer.h (TensorRT 11.1), IDequantizeLayer / IQuantizeLayer: blocks only of INT4, FP4 and FP8,
    # INT4 blocks of 64 or 128 (its "Quantization Schemes"), no zero points; per-channel Q/DQ only on
    # weights. Its quantized graphs are float16 (W8A8, W4A16, W8A16; attention and KV cache too); the
    # token embedding stays float (the INT8 rows' Gather + Cast is untested with TensorRT).
    traits = BackendTraits(graph_dtype="float16", int4_block=128, int4_blocks=(64, 128), symmetric_int4=True,
                           int8_channels=True, int8_embedding=False, unit_kv_scales=True, token_kv_scales=False,
                           dynamic_int8=False, host_memory=False, compiled_vision=True, auto_rank=0)

    def available(self) -> tuple[bool, str]:
        from .probe import tensorrt_available

        return tensorrt_available()

    def require(self) -> None:
        from .probe import require_tensorrt

        require_tensorrt()

    def write_engine(self, graph_file: Path, out_dir: Path, settings: EngineSettings, rewritten) -> tuple[str, dict]:
        from .loader import build_plan

        return "engine.plan", build_plan(graph_file, out_dir, settings.profiles, settings.workspace_bytes,
                                         settings.optimization_level, settings.timing_cache,
                                         None if rewritten is None else rewritten.SerializeToString())

    def finish(self, out_dir: Path, record: ExportRecord, kv_dtype: str, eight_bit_activations: bool,
               dynamic_int8: bool, report: dict, log: Callable[[str], None]) -> dict[str, Any]:
        from .probe import cuda_device

        return {self.name: {"version": report["tensorrt_version"], "gpu": cuda_device()}}

    def problems(self, manifest: Manifest) -> list[str]:
        ok, reason = self.available()
        if not ok:
            return [f"this engine needs TensorRT and an NVIDIA GPU: {reason}"]
        import tensorrt as trt

        from .probe import cuda_device

        problems = []
        built = made(TensorRTBuild, manifest.section(self.name))  # checked as the manifest was read
        if trt.__version__ != built.version:
            problems.append(f"engine built with TensorRT {built.version}, this machine has {trt.__version__}; "
                            "rebuild the engine here (plans are not portable across TensorRT versions)")
        gpu = cuda_device()
        if gpu and gpu["compute_capability"] != built.gpu.compute_capability:
            problems.append(f"engine built for {built.gpu.name} (compute capability "
                            f"{built.gpu.compute_capability}), this GPU is {gpu['name']} "
                            f"({gpu['compute_capability']}); rebuild the engine on this GPU")
        return problems

    def file_problems(self, manifest: Manifest) -> list[str]:
        return []  # the plan is checked by TensorRT as it deserializes it

    def open_runner(self, manifest: Manifest, num_blocks: int, threads: int, spinning: bool) -> StepRunner:
        from .runner import TrtRunner

        kv, limits = manifest.kv, manifest.limits
        return TrtRunner(manifest.engine_path, manifest.spec, num_blocks, kv.block_size, kv.dtype,
                         limits.max_batch_size, limits.max_input_len, limits.max_seq_len)

    def graph_runner(self, manifest: Manifest, threads: int):
        return None  # the plan runs on the GPU through TrtRunner only

    def build_lines(self, report: dict) -> list[str]:
        return [f"layers       {report.get('layers')} ({report.get('fused_count')} fused)"]

    def inspect(self, manifest: Manifest, report: dict | None) -> tuple[dict | None, list[str]]:
        return None, []

    def findings(self, manifest: Manifest) -> list[str]:
        return []

    def vision_runs(self, manifest: Manifest) -> str:
        dtype = manifest.build_config.vision_dtype or "float32"
        return f"vision.plan on TensorRT ({dtype} linears and attention)"


BACKEND = TensorRTBackend()
