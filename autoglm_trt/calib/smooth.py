"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights, exactly.

For a linear ``y = x W`` (W is ``[in, out]``) and a positive vector ``s`` over the input
channels, ``y = (x / s) (diag(s) W)``. Choosing ``s_j = max|x_j|^a / max|W_j|^(1-a)``
flattens the outlier channels of x that break per-tensor INT8. The ``1/s`` is folded into
whatever produces x, so the float model is unchanged (up to rounding):

* QKV and gate/up inputs come from an RMSNorm: its weight is divided by s;
* the o_proj input is softmax(QK^T) V, linear in V: V's output columns (and bias) are divided
  by s; with GQA a V channel feeds a whole group of query heads, so s is shared in the group;
* the down input is silu(gate) * up, linear in up: up's output columns are divided by s.
"""

from __future__ import annotations

import numpy as np

from ..model.spec import ModelSpec
from ..model.weights import WeightSource

MIN_SCALE, MAX_SCALE = 1e-5, 1e5


def smoothing_scale(act_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """``s = act_max^alpha / w_max^(1-alpha)``, clipped to a sane range; 1 where either is 0."""
    act_max = np.asarray(act_max, np.float64)
    w_max = np.asarray(w_max, np.float64)
    ok = (act_max > 0) & (w_max > 0)
    s = np.ones_like(act_max)
    s[ok] = act_max[ok] ** alpha / w_max[ok] ** (1.0 - alpha)
    return np.clip(s, MIN_SCALE, MAX_SCALE).astype(np.float32)


def group_shared(v: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Max over the query heads of each KV group: ``[q_size] -> [kv_size]``."""
    grp = spec.num_heads // spec.num_kv_heads
    return v.reshape(spec.num_kv_heads, grp, spec.head_dim).max(axis=1).reshape(-1)


def expand_groups(v_kv: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """``[kv_size] -> [q_size]``: each KV channel's value for every query head of its group."""
    grp = spec.num_heads // spec.num_kv_heads
    return np.repeat(v_kv.reshape(spec.num_kv_heads, 1, spec.head_dim), grp, axis=1).reshape(-1)


def weight_row_max(spec: ModelSpec, weights: WeightSource, layers: list[int] | None = None) -> dict[str, np.ndarray]:
    """max |W| over the output channels, for each input channel of every linear (of ``layers``, if given)."""
    out = {}
    for i in range(spec.num_layers) if layers is None else layers:
        p = f"layers.{i}"
        out[f"{p}.qkv"] = abs_max(weights.qkv(i)[0], axis=1)
        out[f"{p}.o_proj"] = abs_max(weights.o_proj(i)[0], axis=1)
        out[f"{p}.gate_up"] = abs_max(weights.gate_up(i), axis=1)
        out[f"{p}.down"] = abs_max(weights.down(i), axis=1)
    return out


def abs_max(x: np.ndarray, axis: int) -> np.ndarray:
    """max |x| along ``axis``, exactly, as max(max x, -min x): two reductions and no |x| copy."""
    return np.maximum(x.max(axis=axis), -x.min(axis=axis))


def smoothing_scales(spec: ModelSpec, w_max: dict[str, np.ndarray], act_max: dict[str, np.ndarray],
                     alpha: float) -> dict[str, np.ndarray]:
    """Smoothing vectors of every linear from per-channel activation and weight maxima."""
    out = {}
    for name, wm in w_max.items():
        if name.endswith(".o_proj"):  # shared by the query heads of a KV group (see the module docstring)
            s_kv = smoothing_scale(group_shared(act_max[name], spec), group_shared(wm, spec), alpha)
            out[name] = expand_groups(s_kv, spec)
        else:
            out[name] = smoothing_scale(act_max[name], wm, alpha)
    return out


class SmoothedWeights:
    """A ``WeightSource`` with the smoothing vectors folded in (see the module docstring)."""

    def __init__(self, base: WeightSource, spec: ModelSpec, scales: dict[str, np.ndarray]):
        self.base, self.spec, self.scales = base, spec, scales

    def _s(self, i: int, linear: str) -> np.ndarray | None:
        return self.scales.get(f"layers.{i}.{linear}")

    def norm(self, i: int | None, role: str) -> np.ndarray:
        w = self.base.norm(i, role)
        linear = {"input": "qkv", "mlp": "gate_up"}.get(role)
        s = self._s(i, linear) if (i is not None and linear) else None
        return w if s is None else w / s

    def qkv(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        w, b = self.base.qkv(i)
        w = w.astype(np.float32, copy=True)
        b = None if b is None else b.astype(np.float32, copy=True)
        s_in, s_o = self._s(i, "qkv"), self._s(i, "o_proj")
        if s_in is not None:
            w *= s_in[:, None]
        if s_o is not None:
            v = slice(self.spec.q_size + self.spec.kv_size, self.spec.q_size + 2 * self.spec.kv_size)
            s_kv = group_shared(s_o, self.spec)
            w[:, v] /= s_kv
            if b is not None:
                b[v] /= s_kv
        return w, b

    def o_proj(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        w, b = self.base.o_proj(i)
        s = self._s(i, "o_proj")
        return (w if s is None else w * s[:, None]), b

    def gate_up(self, i: int) -> np.ndarray:
        w = self.base.gate_up(i).astype(np.float32, copy=True)
        s_in, s_down = self._s(i, "gate_up"), self._s(i, "down")
        if s_in is not None:
            w *= s_in[:, None]
        if s_down is not None:
            w[:, self.spec.intermediate_size:] /= s_down
        return w

    def down(self, i: int) -> np.ndarray:
        w = self.base.down(i)
        s = self._s(i, "down")
        return w if s is None else w * s[:, None]

    def embedding_name(self) -> str:
        return self.base.embedding_name()

    def lm_head_name(self) -> str | None:
        return self.base.lm_head_name()

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.base.rows(name, start, stop)
