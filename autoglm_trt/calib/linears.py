"""The quantizable linears of a decoder, by name: ``layers.<i>.<kind>`` and ``lm_head``."""

from __future__ import annotations

from ..arch import ModelSpec

KINDS = ("qkv", "o_proj", "gate_up", "down", "lm_head")


def kind_of(linear: str) -> str:
    """``layers.3.down`` -> ``down``; ``lm_head`` -> ``lm_head``."""
    return linear.rsplit(".", 1)[-1]


def all_linears(spec: ModelSpec) -> list[str]:
    return [f"layers.{i}.{k}" for i in range(spec.num_layers) for k in KINDS[:-1]] + ["lm_head"]


def input_channels(spec: ModelSpec, linear: str) -> int:
    return {"o_proj": spec.q_size, "down": spec.intermediate_size}.get(kind_of(linear), spec.hidden_size)


def num_params(spec: ModelSpec, linear: str) -> int:
    """Weights of one linear (the LM head counted even when tied to the embedding)."""
    out = {"qkv": spec.q_size + 2 * spec.kv_size, "o_proj": spec.hidden_size, "gate_up": 2 * spec.intermediate_size,
           "down": spec.hidden_size, "lm_head": spec.vocab_size}[kind_of(linear)]
    return input_channels(spec, linear) * out
