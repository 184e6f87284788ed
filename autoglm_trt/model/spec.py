"""Architecture families and the model spec read from ``config.json``.

Input: a checkpoint's ``config.json`` (a dict). Output: a ``ModelSpec``: the sizes, the rope
parameters, and the family (a few lines of data that say where the family differs, and the
Hugging Face names of its tensors). Export, calibration and build only read the spec; model
knowledge lives here alone.

Adding a family is adding a ``Family`` entry to ``FAMILIES`` (and, if its checkpoint names
tensors differently, a ``TensorNames``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import UnsupportedModelError
from .rope import SUPPORTED_ROPE_TYPES, RopeSpec

# The graph's names for the norms of a layer (``layers.<i>.<role>_norm``) and the final one.
NORM_ROLES = ("input", "post_attn", "mlp", "post_mlp")


@dataclass(frozen=True)
class TensorNames:
    """Where a family's checkpoint keeps each tensor (``{p}``: ``model.`` or nothing, ``{i}``: layer)."""

    embedding: str = "{p}embed_tokens.weight"
    final_norm: str = "{p}norm.weight"
    lm_head: str = "lm_head.weight"
    norms: tuple[tuple[str, str], ...] = (("input", "input_layernorm"), ("post_attn", "post_self_attn_layernorm"),
                                          ("mlp", "post_attention_layernorm"), ("post_mlp", "post_mlp_layernorm"))
    attention: str = "{p}layers.{i}.self_attn.{proj}"  # proj: q_proj, k_proj, v_proj, o_proj
    gate_up: str = "{p}layers.{i}.mlp.gate_up_proj.weight"  # fused families
    gate: str = "{p}layers.{i}.mlp.gate_proj.weight"
    up: str = "{p}layers.{i}.mlp.up_proj.weight"
    down: str = "{p}layers.{i}.mlp.down_proj.weight"
    prefixes: tuple[str, ...] = ("model.", "")  # tried in order: the first with an embedding wins

    def norm(self, prefix: str, i: int | None, role: str) -> str:
        if i is None:
            return self.final_norm.format(p=prefix)
        return f"{prefix}layers.{i}.{dict(self.norms)[role]}.weight"


@dataclass(frozen=True)
class Family:
    """How one architecture family lays out its weights and blocks."""

    name: str
    architectures: tuple[str, ...]
    rope_interleaved: bool  # rotates pairs (2i, 2i+1) instead of (i, i + d/2)
    gate_up_fused: bool  # the checkpoint stores mlp.gate_up_proj (gate rows first, then up)
    sandwich_norms: bool  # extra RMSNorm after attention and after the MLP (GLM-4-0414)
    default_partial_rotary: float = 1.0
    names: TensorNames = field(default_factory=TensorNames)
    vision: bool = False  # a vision tower in front: the decoder takes image embeddings (``graph.vision``)


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", ("LlamaForCausalLM",), rope_interleaved=False, gate_up_fused=False,
                    sandwich_norms=False),
    "glm": Family("glm", ("GlmForCausalLM",), rope_interleaved=True, gate_up_fused=True,
                  sandwich_norms=False, default_partial_rotary=0.5),
    "glm4": Family("glm4", ("Glm4ForCausalLM",), rope_interleaved=True, gate_up_fused=True,
                   sandwich_norms=True, default_partial_rotary=0.5),
    # GLM-4.1V (AutoGLM-Phone-9B): a GLM-4-0414 decoder under model.language_model, with M-RoPE
    # (mrope_section) and a vision tower under model.visual; config.json nests text_config
    "glm4v": Family("glm4v", ("Glm4vForConditionalGeneration",), rope_interleaved=True, gate_up_fused=True,
                    sandwich_norms=True, default_partial_rotary=0.5,
                    names=TensorNames(prefixes=("model.language_model.",)), vision=True),
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
    # M-RoPE (GLM-4.1V): the rotary frequencies split into temporal, height and width sections, each
    # turned by its own row of 3-D positions; () for 1-D rope
    mrope_section: tuple[int, ...] = ()

    @property
    def mrope(self) -> bool:
        return bool(self.mrope_section)

    @property
    def vision(self) -> bool:
        return self.fam.vision

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_dims(self, kind: str) -> tuple[int, int]:
        """(input, output) channels of one linear of a kind: qkv, o_proj, gate_up, down, lm_head."""
        return {"qkv": (self.hidden_size, self.q_size + 2 * self.kv_size), "o_proj": (self.q_size, self.hidden_size),
                "gate_up": (self.hidden_size, 2 * self.intermediate_size),
                "down": (self.intermediate_size, self.hidden_size),
                "lm_head": (self.hidden_size, self.vocab_size)}[kind]

    def num_parameters(self) -> int:
        """Parameters of the linears and embeddings (norms and biases left out)."""
        per_layer = sum(a * b for a, b in map(self.linear_dims, ("qkv", "o_proj", "gate_up", "down")))
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer

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
    if model_type == "glm4v":
        config = _text_config(config)
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {_brief(model_type)} (architectures: {_brief(config.get('architectures'))}) is not supported; "
            f"supported model types: {', '.join(supported_model_types())}"
        )
    fam = FAMILIES[model_type]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {_brief(act)} is not supported; only 'silu' is")
    if config.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    c = _Fields(config, model_type)
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    head_dim = c.int("head_dim", hidden // heads if hidden % heads == 0 else None)
    kv_heads = c.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    eos = config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(_is_int(e) and e >= 0 for e in eos_ids):
        raise UnsupportedModelError(f"config.json eos_token_id must be a token id or a list of them, got {_brief(eos)}")
    bos = config.get("bos_token_id")
    if bos is not None and not (_is_int(bos) and bos >= 0):
        raise UnsupportedModelError(f"config.json bos_token_id must be a token id or null, got {_brief(bos)}")
    rope = _rope_from_config(config, fam, head_dim)
    mrope = tuple(rope.scaling.pop("mrope_section", ()))
    if mrope and (len(mrope) != 3 or not all(_is_int(m) and m >= 0 for m in mrope) or sum(mrope) != rope.rotary_dim // 2):
        raise UnsupportedModelError(f"config.json mrope_section must be three sizes that sum to the rotated pairs "
                                    f"({rope.rotary_dim // 2}), got {_brief(list(mrope))}")
    if model_type == "glm4v" and not mrope:
        raise UnsupportedModelError("a glm4v config.json needs text_config.rope_parameters.mrope_section")
    return ModelSpec(
        family=model_type, vocab_size=c.int("vocab_size"), hidden_size=hidden,
        intermediate_size=c.int("intermediate_size"), num_layers=c.int("num_hidden_layers"), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=c.float("rms_norm_eps", 1e-6),
        rope=rope, max_position_embeddings=c.int("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=bos, eos_token_ids=tuple(int(e) for e in eos_ids), mrope_section=mrope,
    )


def _text_config(config: dict) -> dict:
    """A glm4v config.json's text decoder fields (``text_config``) with the top level's token ids
    and embedding tying, as one flat config of ``model_type`` glm4v."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"a glm4v config.json needs a text_config object, got {_brief(text)}")
    flat = {**text, "model_type": "glm4v"}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if config.get(key) is not None and flat.get(key) is None:
            flat[key] = config[key]
    return flat


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _brief(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:59] + "…"


class _Fields:
    """Typed, range-checked reads of config.json fields (a wrong one is an ``UnsupportedModelError``)."""

    def __init__(self, config: dict, model_type: str):
        self.config, self.model_type = config, model_type

    def _get(self, key: str, default: object) -> object:
        value = self.config.get(key)
        if value is None:
            if default is None:
                raise UnsupportedModelError(f"config.json lacks the field '{key}', which a {self.model_type} model needs")
            return default
        return value

    def int(self, key: str, default: int | None = None) -> int:
        value = self._get(key, default)
        if not _is_int(value) or value < 1:  # type: ignore[operator]
            raise UnsupportedModelError(f"config.json field '{key}' must be an integer >= 1, got {_brief(value)}")
        return value  # type: ignore[return-value]

    def float(self, key: str, default: float) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
            raise UnsupportedModelError(f"config.json field '{key}' must be a number in (0, 1), got {_brief(value)}")
        return float(value)


def _rope_from_config(config: dict, fam: Family, head_dim: int) -> RopeSpec:
    # transformers >= 5 writes "rope_parameters"; older configs have rope_theta,
    # partial_rotary_factor and rope_scaling at the top level.
    params, scaling = config.get("rope_parameters") or {}, config.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise UnsupportedModelError(f"config.json field '{key}' must be an object, got {_brief(value)}")
    params, scaling = dict(params), dict(scaling)
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", fam.default_partial_rotary))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {_brief(rope_type)} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e12:
            raise UnsupportedModelError(f"config.json {name} must be a positive number, got {_brief(value)}")
    if partial > 1:
        raise UnsupportedModelError(f"config.json partial_rotary_factor must be at most 1, got {partial}")
    merged = {**scaling, **params}
    extra = {k: v for k, v in merged.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_type", "type")}
    rotary_dim = int(head_dim * float(partial))
    if rotary_dim % 2:
        raise UnsupportedModelError(f"rotary dimension {rotary_dim} is odd")
    return RopeSpec(theta=float(theta), rotary_dim=rotary_dim, rope_type=rope_type, scaling=extra)


def spec_from_dict(d: dict) -> ModelSpec:
    """Inverse of ``ModelSpec.to_json`` (ValueError: a field is not what ``to_json`` writes)."""
    d = dict(d)
    for key, kind, what in (("rope", dict, "an object"), ("eos_token_ids", (list, tuple), "a list"),
                            ("mrope_section", (list, tuple), "a list")):
        if not isinstance(d.get(key, []), kind):
            raise ValueError(f"{key} must be {what}, got {_brief(d[key])}")
    d["rope"] = RopeSpec(**d["rope"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    d["mrope_section"] = tuple(d.get("mrope_section", ()))
    spec = ModelSpec(**d)
    why = _malformed(spec)
    if why is not None:
        raise ValueError(why)
    return spec


def _malformed(s: ModelSpec) -> str | None:
    """What is wrong with a spec read from a record (a field of the wrong type or range), or None."""

    def whole(v: object, least: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= least

    def number(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < float("inf")

    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "max_position_embeddings")
    checks = [("family", s.family, isinstance(s.family, str) and s.family in FAMILIES, f"one of {', '.join(FAMILIES)}"),
              *((n, getattr(s, n), whole(getattr(s, n), 1), "an integer >= 1") for n in sizes),
              ("rms_norm_eps", s.rms_norm_eps, number(s.rms_norm_eps), "a number > 0"),
              ("tie_word_embeddings", s.tie_word_embeddings, isinstance(s.tie_word_embeddings, bool), "true or false"),
              ("bos_token_id", s.bos_token_id, s.bos_token_id is None or whole(s.bos_token_id, 0),
               "null or an integer >= 0"),
              ("eos_token_ids", s.eos_token_ids, all(whole(t, 0) for t in s.eos_token_ids), "integers >= 0"),
              ("mrope_section", s.mrope_section, all(whole(t, 1) for t in s.mrope_section), "integers >= 1"),
              ("rope.theta", s.rope.theta, number(s.rope.theta), "a number > 0"),
              ("rope.rotary_dim", s.rope.rotary_dim, whole(s.rope.rotary_dim, 0), "an integer >= 0"),
              ("rope.rope_type", s.rope.rope_type, s.rope.rope_type in SUPPORTED_ROPE_TYPES,
               f"one of {', '.join(SUPPORTED_ROPE_TYPES)}"),
              ("rope.scaling", s.rope.scaling, isinstance(s.rope.scaling, dict), "an object")]
    return next((f"{name} must be {want}, got {_brief(value)}" for name, value, ok, want in checks if not ok), None)
