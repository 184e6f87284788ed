"""Architecture families and the model spec read from ``config.json``.

Input: a checkpoint's ``config.json`` (a dict). Output: a ``ModelSpec``: the sizes, the rope
parameters, and the family (a few lines of data that say where the family differs). Export,
calibration and build only read the spec; model knowledge lives here alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import UnsupportedModelError
from .rope import SUPPORTED_ROPE_TYPES, RopeSpec


@dataclass(frozen=True)
class Family:
    """How one architecture family lays out its weights and blocks."""

    name: str
    architectures: tuple[str, ...]
    rope_interleaved: bool  # rotates pairs (2i, 2i+1) instead of (i, i + d/2)
    gate_up_fused: bool  # the checkpoint stores mlp.gate_up_proj (gate rows first, then up)
    sandwich_norms: bool  # extra RMSNorm after attention and after the MLP (GLM-4-0414)
    default_partial_rotary: float = 1.0


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", ("LlamaForCausalLM",), rope_interleaved=False, gate_up_fused=False,
                    sandwich_norms=False),
    "glm": Family("glm", ("GlmForCausalLM",), rope_interleaved=True, gate_up_fused=True,
                  sandwich_norms=False, default_partial_rotary=0.5),
    "glm4": Family("glm4", ("Glm4ForCausalLM",), rope_interleaved=True, gate_up_fused=True,
                   sandwich_norms=True, default_partial_rotary=0.5),
}


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a model that the graph needs, read from its config."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> dict:
        d = asdict(self)
        d["rope"] = asdict(self.rope)
        return d


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def spec_from_config(config: dict) -> ModelSpec:
    """Read a ``ModelSpec`` from a Hugging Face ``config.json`` dict.

    Raises:
        UnsupportedModelError: unknown ``model_type`` (the message lists the supported ones), or
            an option this exporter does not implement.
    """
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type '{model_type}' (architectures: {config.get('architectures')}) is not supported; "
            f"supported model types: {', '.join(supported_model_types())}"
        )
    fam = FAMILIES[model_type]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act '{act}' is not supported; only 'silu' is")
    if config.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        spec_head_dim = config.get("head_dim") or hidden // heads
        rope = _rope_from_config(config, fam, int(spec_head_dim))
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelSpec(
            family=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(spec_head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
    except KeyError as exc:
        raise UnsupportedModelError(f"config.json lacks the field {exc}, which a {model_type} model needs") from exc


def _rope_from_config(config: dict, fam: Family, head_dim: int) -> RopeSpec:
    # transformers >= 5 writes "rope_parameters"; older configs have rope_theta,
    # partial_rotary_factor and rope_scaling at the top level.
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", fam.default_partial_rotary))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    merged = {**scaling, **params}
    extra = {k: v for k, v in merged.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_type", "type")}
    rotary_dim = int(head_dim * float(partial))
    if rotary_dim % 2:
        raise UnsupportedModelError(f"rotary dimension {rotary_dim} is odd")
    return RopeSpec(theta=float(theta), rotary_dim=rotary_dim, rope_type=rope_type, scaling=extra)


def spec_from_dict(d: dict) -> ModelSpec:
    """Inverse of ``ModelSpec.to_json``."""
    d = dict(d)
    d["rope"] = RopeSpec(**d["rope"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelSpec(**d)
