"""ONNX Runtime as a ``Backend``: the default, on any CPU; its engine is the optimized ONNX graph,
its plain and native forms (``loader``), run by ``OrtRunner`` with the KV pool in this process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...artifacts import ExportRecord, Manifest
from ...record_schema import untyped
from ..base import BackendTraits, EngineSettings, StepRunner


class OnnxRuntimeBackend:
    name, label = "onnxruntime", "ONNX Runtime"
    # blocks of 32 measured best for ONNX Runtime's MatMulNBits and the native INT4 operator (docs/calibration.md)
    traits = BackendTraits(graph_dtype="float32", int4_block=32, auto_rank=1)

    def available(self) -> tuple[bool, str]:
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return False, "onnxruntime is not installed (pip install onnxruntime)"
        return True, "ONNX Runtime on the CPU"

    def require(self) -> None:
        from ...errors import MissingDependencyError

        ok, why = self.available()
        if not ok:
            raise MissingDependencyError(why)

    def write_engine(self, graph_file: Path, out_dir: Path, settings: EngineSettings, rewritten) -> tuple[str, dict]:
        from .loader import OPT_GRAPH, optimize

        return OPT_GRAPH, optimize(graph_file, out_dir, settings.threads, rewritten)

    def finish(self, out_dir: Path, record: ExportRecord, kv_dtype: str, eight_bit_activations: bool,
               dynamic_int8: bool, report: dict, log: Callable[[str], None]) -> dict[str, Any]:
        """The plain and native graphs (``loader.write_graphs``), and the vision encoder's forms."""
        from .loader import write_graphs

        graphs = write_graphs(out_dir, record.spec, kv_dtype, dynamic_int8=dynamic_int8,
                              bf16_attention=eight_bit_activations)
        done = [f"{p['name']} x{p['applied']}" for p in graphs.passes if p["applied"]]
        log("native graph: " + (", ".join(done) if graphs.native_graph else f"none ({graphs.why})"))
        return {self.name: untyped(graphs), **({"vision": report["vision"]} if "vision" in report else {})}

    def problems(self, manifest: Manifest) -> list[str]:
        ok, why = self.available()
        return [] if ok else [why]

    def file_problems(self, manifest: Manifest) -> list[str]:
        if not manifest.engine_path.is_file():
            return []
        import onnx

        try:
            onnx.load(str(manifest.engine_path), load_external_data=False)
        except Exception as exc:  # noqa: BLE001 - protobuf raises several types for a file that is not ONNX
            return [f"{manifest.engine_path.name} is not a valid ONNX model ({type(exc).__name__}); rebuild the engine"]
        return []

    def open_runner(self, manifest: Manifest, num_blocks: int, threads: int, spinning: bool) -> StepRunner:
        from .runner import OrtRunner

        kv = manifest.kv
        return OrtRunner(manifest.dir, manifest.ort_graphs, manifest.spec, num_blocks, kv.block_size, kv.dtype, threads,
                         spinning=spinning)

    def graph_runner(self, manifest: Manifest, threads: int):
        """The native graph where this machine can run it (``runner.open_session``), else the plain one."""
        from .offline import GraphRunner
        from .passes.common import SLOTS
        from .runner import open_session

        session, _ = open_session(manifest.dir, manifest.ort_graphs, threads)
        slots = SLOTS if SLOTS in {i.name for i in session.get_inputs()} else None
        return GraphRunner(manifest.dir, session=session, no_store=slots)

    def build_lines(self, report: dict) -> list[str]:
        lines = [f"fusions      nodes {report['nodes_before']} -> {report['nodes_after']}"]
        return lines + [f"             {op} x{f['count']}: {f['what']}" for op, f in report["fusions"].items()]

    def inspect(self, manifest: Manifest, report: dict | None) -> tuple[dict | None, list[str]]:
        from .findings import decode_graph, inspect_lines

        decode = decode_graph(manifest, report)
        return decode, inspect_lines(manifest, decode)

    def findings(self, manifest: Manifest) -> list[str]:
        from .findings import native_report

        return native_report(manifest)

    def vision_runs(self, manifest: Manifest) -> str:
        from .vision import vision_graph

        return "{} on ONNX Runtime here: {}".format(*vision_graph(manifest)[:2])


BACKEND = OnnxRuntimeBackend()
