"""The quantizable linears of a decoder, by name: ``layers.<i>.<kind>`` and ``lm_head``."""

from __future__ import annotations

from ..model.spec import ModelSpec

KINDS = ("qkv", "o_proj", "gate_up", "down", "lm_head")


def kind_of(linear: str) -> str:
    """``layers.3.down`` -> ``down``; ``lm_head`` -> ``lm_head``."""
    return linear.rsplit(".", 1)[-1]


def all_linears(spec: ModelSpec) -> list[str]:
    return [f"layers.{i}.{k}" for i in range(spec.num_layers) for k in KINDS[:-1]] + ["lm_head"]


def input_channels(spec: ModelSpec, linear: str) -> int:
    return spec.linear_dims(kind_of(linear))[0]


def num_params(spec: ModelSpec, linear: str) -> int:
    """Weights of one linear (the LM head counted even when tied to the embedding)."""
    d_in, d_out = spec.linear_dims(kind_of(linear))
    return d_in * d_out
