"""Calibration step 5: ``calib.json``, what a calibration was made from and why it is as it is."""

from __future__ import annotations

from ..fileutil import library_versions
from ..graph.names import all_linears, num_params
from ..model.spec import ModelSpec


def float_reasons(keep: list[str], user_keep: list[str], sensitivity: dict | None,
                  errors: dict[str, float]) -> list[dict]:
    """Why each float linear stayed float."""
    out = [{"linear": n, "reason": "user --keep-float"} for n in user_keep]
    for rank, name in enumerate(keep):
        alone = (sensitivity or {}).get("kl_alone", {}).get(name, float("nan"))
        out.append({"linear": name, "reason": f"sensitivity rank {rank + 1} (KL of the logits with only this linear "
                                              f"INT8 {alone:.5f}; INT8 output error of this linear {errors[name]:.4f})"})
    return out


def weight_bytes(spec: ModelSpec, quantized: set[str]) -> dict:
    """What a bandwidth-bound decode step reads per token: linear weights, 1 byte if INT8, else 4."""
    params = {n: num_params(spec, n) for n in all_linears(spec)}
    plan = sum(p * (1 if n in quantized else 4) for n, p in params.items())
    return {"this_plan_mb": round(plan / 1e6, 1), "all_int8_mb": round(sum(params.values()) / 1e6, 1),
            "float32_mb": round(4 * sum(params.values()) / 1e6, 1),
            "note": "linears and LM head only (float32 where not INT8); decode on a CPU is bound by these reads"}


def float_fraction(spec: ModelSpec, keep: list[str]) -> float:
    """Share of the linear weights, LM head included (by parameter count), that stay in float."""
    total = sum(num_params(spec, n) for n in all_linears(spec))
    return round(sum(num_params(spec, n) for n in keep) / total, 4)


def versions() -> dict:
    return library_versions("onnx", "onnxruntime", "numpy")
