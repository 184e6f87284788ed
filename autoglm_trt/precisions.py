"""The precisions an engine is built in, as one frozen table: what each is made from and how.

Code reads a precision's fields (``Precision.model``, ``.eight_bit_activations``, ...) and never
compares its name; a new precision is one row here and the code its ``model`` names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import AutoGLMError


class Form(Enum):
    """What an engine's graph is made from the float export by."""

    FLOAT = "float"  # the float graph itself
    INT8 = "int8"  # calibrated Q/DQ: INT8 weights and activations
    WEIGHT_ONLY = "weight_only"  # INT8 weights alone
    INT4 = "int4"  # INT4 weights: AWQ's scales, GPTQ's rounding


@dataclass(frozen=True)
class Precision:
    name: str
    model: Form
    export_dtype: str = "float32"  # the float export it is made from
    float16_export: bool = False  # whether a float16 export will do (the weights alone are read, widened)
    dynamic_int8: bool = False  # activations quantized per block at run time by the INT8 linears
    eight_bit_activations: bool = False  # activations rounded to 8 bits anyway: bfloat16 prefill attention
    # where AMX has it, and the vision encoder's INT8 linears and bfloat16 attention by default
    calibrated_kv: bool = False  # an INT8 KV cache takes its ranges from the calibration
    help: str = ""

    @property
    def quantized(self) -> bool:
        return self.model is not Form.FLOAT


TABLE = (
    Precision("fp32", Form.FLOAT, help="float32 throughout"),
    Precision("fp16", Form.FLOAT, export_dtype="float16", help="float16 weights and activations"),
    Precision("int8", Form.INT8, eight_bit_activations=True, calibrated_kv=True,
              help="INT8 weights and activations (calibrated)"),
    Precision("int8-wo", Form.WEIGHT_ONLY, float16_export=True,
              help="INT8 weights, activations kept in float (16 bits per block of 32 on the CPU; on TensorRT one "
                   "weight scale per output channel; no calibration; the closest to fp32)"),
    Precision("int8-dyn", Form.WEIGHT_ONLY, float16_export=True, dynamic_int8=True, eight_bit_activations=True,
              help="int8-wo's weights, activations quantized per block of 32 at run time (ONNX Runtime only)"),
    Precision("int4-awq", Form.INT4, eight_bit_activations=True,
              help="INT4 weights (AWQ scales), activations quantized per block at run time"),
)
PRECISIONS = {p.name: p for p in TABLE}
NAMES = tuple(PRECISIONS)


def precision(name: str) -> Precision:
    """The precision called ``name``, or an error that names the choices."""
    try:
        return PRECISIONS[name]
    except (KeyError, TypeError):
        raise AutoGLMError(f"precision '{name}' is not supported; choose one of {', '.join(NAMES)}") from None
