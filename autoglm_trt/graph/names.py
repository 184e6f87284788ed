"""The engine graph's tensor names that code outside the graph builder relies on.

The decoder (``decoder.py``), the quantized linears (``quant.py``), the INT8 KV rewrite and the
ONNX Runtime passes (``backends/onnxrt/passes/``) all take these names from here, so a renamed
tensor is renamed for all of them. Per layer ``i``::

    layers.<i>.qkv_split_0 / _1   the fused QKV output split into query+key heads and values
    layers.<i>.q_grouped          the queries after rope, grouped [B, T, KV heads, G, D]
    layers.<i>.q_t, scores_past, scores_new, scores_t, scores, masked, probs, probs_past, probs_new
                                  the prefill attention's scores and softmax
    layers.<i>.attn               the attention output, [B, T, heads * D]
    layers.<i>.attn_residual, layers.<i>.mlp_residual   the residual stream after each half
    past_key.<i>, past_value.<i>  the block pools (inputs); new_key.<i>, new_value.<i> (outputs)
    past_key_scale.<i>, ...       an INT8 KV cache's per-token scales (``kv_int8.py``): their pools
                                  [kv_heads, num_blocks, block_size] (inputs) and the new tokens'
                                  new_key_scale.<i>, new_value_scale.<i> [batch, tokens, kv_heads]

and, for each INT8 linear's online rotation, the constants ``hadamard_<b>``, ``blocks_<b>_<rank>``
and ``unblocks_<rank>``. The quantizable linears are named ``layers.<i>.<kind>`` and ``lm_head``
(``KINDS``, ``all_linears``): calibration records and ``--keep-float`` use these names.
"""

from __future__ import annotations

from ..model.spec import ModelSpec

INPUT_IDS = "input_ids"
IMAGE_EMBEDS, IMAGE_INDEX = "image_embeds", "image_index"  # vision families' image inputs
BLOCK_TABLES, CONTEXT_LENS, QUERY_LENS = "block_tables", "context_lens", "query_lens"
LOGITS = "logits"
QKV_SPLIT, Q_GROUPED, ATTN = "qkv_split", "q_grouped", "attn"
ATTN_RESIDUAL, MLP_RESIDUAL = "attn_residual", "mlp_residual"
RESIDUAL_SUFFIXES = (f".{ATTN_RESIDUAL}", f".{MLP_RESIDUAL}")
# the prefill attention's parts, in order
Q_T, SCORES_PAST, SCORES_NEW, SCORES_T, SCORES = "q_t", "scores_past", "scores_new", "scores_t", "scores"
MASKED, PROBS, PROBS_PAST, PROBS_NEW = "masked", "probs", "probs_past", "probs_new"
HADAMARD_PREFIX, BLOCKS_PREFIX, UNBLOCKS_PREFIX = "hadamard_", "blocks_", "unblocks_"


def layer(i: int) -> str:
    """The prefix of layer ``i``'s tensors."""
    return f"layers.{i}"


def in_layer(i: int, part: str) -> str:
    """Layer ``i``'s tensor ``part`` (``q_grouped``, ``attn``, ``scores``, ...)."""
    return f"layers.{i}.{part}"


def past_key(i: int) -> str:
    return f"past_key.{i}"


def past_value(i: int) -> str:
    return f"past_value.{i}"


def new_key(i: int) -> str:
    return f"new_key.{i}"


def new_value(i: int) -> str:
    return f"new_value.{i}"


def scale_of(kv_name: str) -> str:
    """The per-token scales that go with a pool or new K/V tensor of an INT8 KV cache:
    ``past_key.3`` -> ``past_key_scale.3``, ``new_value.0`` -> ``new_value_scale.0``."""
    kind, layer_no = kv_name.split(".")
    return f"{kind}_scale.{layer_no}"


def hadamard(b: int) -> str:
    return f"{HADAMARD_PREFIX}{b}"


def blocks_shape(b: int, rank: int) -> str:
    return f"{BLOCKS_PREFIX}{b}_{rank}"


def unblocks_shape(rank: int) -> str:
    return f"{UNBLOCKS_PREFIX}{rank}"


# -- the quantizable linears ------------------------------------------------------------------
KINDS = ("qkv", "o_proj", "gate_up", "down", "lm_head")


def kind_of(linear: str) -> str:
    """``layers.3.down`` -> ``down``; ``lm_head`` -> ``lm_head``."""
    return linear.rsplit(".", 1)[-1]


def layer_of(linear: str) -> int | None:
    """``layers.3.down`` -> 3; ``lm_head`` -> None."""
    parts = linear.split(".")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "layers" else None


def all_linears(spec: ModelSpec) -> list[str]:
    return [in_layer(i, k) for i in range(spec.num_layers) for k in KINDS[:-1]] + ["lm_head"]


def input_channels(spec: ModelSpec, linear: str) -> int:
    return spec.linear_dims(kind_of(linear))[0]


def num_params(spec: ModelSpec, linear: str) -> int:
    """Weights of one linear (the LM head counted even when tied to the embedding)."""
    d_in, d_out = spec.linear_dims(kind_of(linear))
    return d_in * d_out
