"""The one place ONNX Runtime sessions are made (CPU execution provider).

Every session of this project (validation, calibration statistics, the accuracy gate, eval,
the ONNX Runtime backend's build and its runner) comes from ``make_session``, so options such
as threads, optimization level and logging are set the same way everywhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MAX_THREADS = 256


def session_options(threads: int | None = None, optimize: bool = True, external_data_dir: Path | None = None,
                    save_optimized: Path | None = None, custom_ops: Path | None = None,
                    initializers: dict | None = None, float_qdq: bool = False, spinning: bool = True,
                    prepacking: bool = True):
    """``SessionOptions``: threads (0 or None: ONNX Runtime's default, one per core), all graph
    optimizations or none, where external weights lie (for a model passed as bytes), where
    to save the optimized model (its weights in ``<name>.data``), a custom operator library, and
    initializers (``OrtValue``s by name) that the session reads in place, without a copy
    (``add_initializer``: they replace the graph's initializers of those names, which the graph
    declares as external data of their type and shape; the caller keeps the arrays alive).
    ``float_qdq``: Q/DQ pairs run as written, in float, instead of fused into ONNX Runtime's
    integer kernels, which on a CPU without VNNI saturate 16-bit pair sums (u8 x s8 through
    ``vpmaddubsw``): the float form equals an exact integer product to float rounding on
    every instruction set. ``spinning``: the intra-op threads spin between operators waiting for
    work (ONNX Runtime's default) or block: spinning threads take cores from the work of other
    sessions that run at the same time (``runtime.engine``'s ``spinning``). ``prepacking`` off: the
    kernels do not copy their weights into their own layouts, which a session made only to save
    its optimized graph never runs (a second copy of every weight: a 9B's would not fit)."""
    import onnxruntime as ort

    from ...errors import AutoGLMError

    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 3
    if threads:
        if not isinstance(threads, int) or isinstance(threads, bool) or not 0 < threads <= MAX_THREADS:
            raise AutoGLMError(f"threads must be an integer from 0 (one per core) to {MAX_THREADS}, got {threads!r}")
        so.intra_op_num_threads = threads
    if external_data_dir is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                    str(Path(external_data_dir).resolve()))
    if save_optimized is not None:
        so.optimized_model_filepath = str(save_optimized)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                    f"{Path(save_optimized).name}.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    if custom_ops is not None:
        so.register_custom_ops_library(str(custom_ops))
    for name, value in (initializers or {}).items():
        so.add_initializer(name, value)
    if float_qdq:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if not prepacking:
        so.add_session_config_entry("session.disable_prepacking", "1")
    return so


DEVICES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def make_session(model: Path | bytes, threads: int | None = None, optimize: bool = True,
                 external_data_dir: Path | None = None, save_optimized: Path | None = None, device: str = "cpu",
                 custom_ops: Path | None = None, initializers: dict[str, np.ndarray] | None = None,
                 float_qdq: bool = False, spinning: bool = True, prepacking: bool = True, qdq_fusion: bool = True):
    """An ``InferenceSession`` over a model file or serialized model bytes, on the CPU or (``device``
    "cuda", where onnxruntime-gpu is installed) on a GPU through the CUDA execution provider.
    ``initializers``: arrays by name, see ``session_options``; the session holds them
    (``in_place_initializers``) for as long as it lives; ``spinning``, ``prepacking``: see
    ``session_options``. ``qdq_fusion`` off: no Q/DQ node group is fused into another operator
    (``switchable_session``)."""
    import onnxruntime as ort

    from ...errors import AutoGLMError

    if device not in DEVICES:
        raise AutoGLMError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    provider = DEVICES[device]
    if provider not in ort.get_available_providers():
        raise AutoGLMError(f"device {device} needs ONNX Runtime's {provider}, which this onnxruntime "
                           f"{ort.__version__} does not have (it has {', '.join(ort.get_available_providers())}); "
                           "install onnxruntime-gpu for CUDA, or use the CPU")
    values = {name: ort.OrtValue.ortvalue_from_numpy(arr) for name, arr in (initializers or {}).items()}
    so = session_options(threads, optimize, external_data_dir, save_optimized, custom_ops, values, float_qdq, spinning,
                         prepacking)
    source = model if isinstance(model, bytes) else str(model)
    session = ort.InferenceSession(source, so, providers=[provider] + (["CPUExecutionProvider"] if device != "cpu" else []),
                                   disabled_optimizers=None if qdq_fusion else ["QDQSelectorActionTransformer"])
    session.in_place_initializers = dict(initializers or {})  # the session reads their memory: they live
    session.in_place_values = values  # as long as it does
    return session


def switchable_session(path: Path, threads: int | None = None):
    """A session over an accuracy gate's switchable graph (``graph.qdq``: each linear an ``If``
    between its quantized and its kept product, their MatMuls and DequantizeLinear in the branches,
    the weights outside them). No Q/DQ group is fused: that fusion does not find a branch's weights
    outside it, and the search measures Q/DQ in float. No weight is prepacked: MLAS multiplies by a
    prepacked weight with another kernel, whose sums round differently, and a kept branch's weight
    is a constant where a quantized branch's is dequantized at run time. Unpacked, both branches
    multiply alike, and what a linear's switch changes is its quantization alone (a linear outside
    the plan, kept in float throughout, multiplies unpacked too)."""
    return make_session(path, threads=threads, prepacking=False, qdq_fusion=False)


def run(session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All outputs of one run, by name."""
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))
