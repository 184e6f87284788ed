"""The decoder graph: one ONNX graph for prefill and decode over a paged KV cache.

Input: a ``ModelSpec`` and a ``WeightReader``. Output: the nodes and weights, streamed into a
``GraphBuilder``. The graph's contract (the same for ONNX Runtime and TensorRT)::

    input_ids      int64 [batch, new_tokens]   new tokens, right-padded per sequence
    position_ids   int64 [batch, new_tokens]   their positions (context_len + t)
    context_lens   int64 [batch]               tokens of each sequence already in the pool
    query_lens     int64 [batch]               valid new tokens of each sequence (>= 1)
    block_tables   int64 [batch, max_blocks]   pool block ids of each sequence, in order
    logits_indices int64 [batch, num_logits]   which new tokens to compute logits for
                                               (the runtime passes query_lens - 1; eval passes all)
    image_embeds   f32   [image_rows, hidden]  vision families only: the image tokens' embeddings
    image_index    int64 [batch, new_tokens]   (the encoder's output); a token with index k > 0
                                               takes row k instead of its token embedding (row 0
                                               is never taken: 0 means "a text token")
    past_key.<i>   kv    [kv_heads, num_blocks, block_size, head_dim]   (read only)
    past_value.<i> kv    [kv_heads, num_blocks, block_size, head_dim]
    ->
    logits         f32   [batch, num_logits, vocab]
    new_key.<i>    kv    [batch, new_tokens, kv_heads, head_dim]   to be written to the pool
    new_value.<i>  kv    [batch, new_tokens, kv_heads, head_dim]

Attention of sequence b: its past keys are gathered from the pool through its block table
(max_blocks * block_size of them, of which the first context_lens[b] are valid), the new keys
are appended, and every new token attends causally::

    keys:   | block_tables[b,0] | block_tables[b,1] | ... | new 0 .. new T-1 |
    valid:  | <-- context_lens[b] --> ...(masked)...      | t' <= t, t' < query_lens[b] |

The work grows with max_blocks (the longest context in the batch), never with the pool size.
Past and new keys are attended separately and the two score blocks joined, so the past is
read where the Gather puts it: no transpose or concatenation copies it (see ``paged_attention``).
Numerically sensitive parts (RMSNorm, rope, softmax, the residual stream, logits) are float32;
with ``dtype=float16`` the weights, GEMMs and the KV cache are float16 (a plan's Q/DQ and
dequantized weights too: TensorRT's form of the quantized precisions). With a ``QuantPlan``
the planned linears get INT8 Q/DQ in TensorRT's explicit-quantization placement: a
QuantizeLinear/DequantizeLinear pair on the activation input of the MatMul (per-tensor scale)
and a DequantizeLinear on its INT8 weight (per-output-channel scale); norms, softmax,
residuals, embeddings and everything not planned stay in float.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ..model.rope import cos_sin_tables, full_width_tables, rotate_half_matrix
from ..model.spec import ModelSpec
from ..model.weights import WeightSource
from ..quant.int8 import embedding_rows
from ..quant.plan import WEIGHT_BLOCK, QuantPlan
from . import names
from .builder import GraphBuilder, row_chunks
from .qdq import add_bias, quantized_matmul, quantized_rows_matmul

OPSET = 17
WEIGHT_ONLY_OPSET = 21  # DequantizeLinear in blocks
# The graph's layout as this code writes it; a cached export of another version is redone.
# 2: rope for q and k together in four nodes, new K/V named at their producer (no Identity),
#    pools [kv_heads, num_blocks, block_size, head_dim], past and new keys attended separately.
# 3: export.json names the longest sequence max_seq_len, as the build config and manifest do.
# 4: a vision family's decoder takes image_embeds and image_index; its export holds the encoder.
GRAPH_VERSION = 4
NEG_INF = -1.0e9  # finite, so a row with no valid key gives a uniform softmax, not NaN
EMBED_CHUNK_ROWS = 8192
LM_HEAD_STREAM_BYTES = 512 * 1024**2  # an INT8 LM head larger than this in float32 is quantized in chunks


@dataclass(frozen=True)
class GraphOptions:
    dtype: str = "float32"  # weights, GEMMs and KV cache: float32 | float16
    max_seq_len: int = 4096  # the longest sequence the graph allows (its rope tables' length)
    quant: QuantPlan | None = None
    opset: int = OPSET  # 21 for a weight-only plan's blocked DequantizeLinear

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def onnx_dtype(self) -> int:
        return TensorProto.FLOAT if self.dtype == "float32" else TensorProto.FLOAT16


def io_names(num_layers: int, vision: bool = False) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "position_ids", "context_lens", "query_lens", "block_tables", "logits_indices"]
    if vision:
        inputs += [names.IMAGE_EMBEDS, names.IMAGE_INDEX]
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [names.past_key(i), names.past_value(i)]
        outputs += [names.new_key(i), names.new_value(i)]
    return inputs, outputs


class DecoderGraph:
    """Writes the decoder into a ``GraphBuilder`` (call ``build`` once)."""

    def __init__(self, g: GraphBuilder, spec: ModelSpec, weights: WeightSource, opts: GraphOptions,
                 progress: Callable[[int, int], None] | None = None):
        self.g, self.spec, self.w, self.opts = g, spec, weights, opts
        self.progress = progress
        self.wdt = opts.np_dtype

    # -- helpers -----------------------------------------------------------------
    def to_compute(self, x: str) -> str:
        return x if self.opts.dtype == "float32" else self.g.op("Cast", [x], "cast_h", to=self.opts.onnx_dtype)

    def to_f32(self, x: str) -> str:
        return x if self.opts.dtype == "float32" else self.g.op("Cast", [x], "cast_f", to=TensorProto.FLOAT)

    def half(self) -> np.dtype | None:
        """The GEMMs' type where it is not float32, else None."""
        return None if self.opts.dtype == "float32" else self.wdt

    def quantized(self, name: str) -> bool:
        return self.opts.quant is not None and name in self.opts.quant.act_amax

    def linear(self, x: str, w: np.ndarray, b: np.ndarray | None, name: str, rank: int = 3) -> str:
        """float32 x (``rank`` dims) -> MatMul in the weight dtype (+ bias) -> float32; INT8 Q/DQ if planned."""
        g = self.g
        quant = self.opts.quant
        if quant is not None and name in quant.act_amax:  # in a float16 graph: Q/DQ and GEMM in float16
            return add_bias(g, self.to_f32(quantized_matmul(g, x, w, name, quant, rank, self.half())), b, name, quant)
        y = g.op("MatMul", [self.to_compute(x), g.weight(f"{name}.weight", w.astype(self.wdt))], name)
        if b is not None:
            y = g.op("Add", [y, g.weight(f"{name}.bias", b.astype(self.wdt))], f"{name}_bias")
        return self.to_f32(y)

    def rms_norm(self, x: str, weight: np.ndarray, name: str) -> str:
        # Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul: the pattern ONNX Runtime fuses into
        # SimplifiedLayerNormalization and TensorRT into one normalization kernel.
        g = self.g
        sq = g.op("Pow", [x, g.const(np.float32(2.0), "two")], f"{name}_sq")
        if self.opts.opset >= 18:  # the axes an input from opset 18 on
            var = g.op("ReduceMean", [sq, g.ints([-1], "axis_last")], f"{name}_var", keepdims=1)
        else:
            var = g.op("ReduceMean", [sq], f"{name}_var", axes=[-1], keepdims=1)
        std = g.op("Sqrt", [g.op("Add", [var, g.const(np.float32(self.spec.rms_norm_eps), "eps")])], f"{name}_std")
        normed = g.op("Div", [x, std], f"{name}_div")
        return g.op("Mul", [normed, g.weight(f"{name}.weight", weight.astype(np.float32))], name)

    def rope(self, x: str, cos: str, sin: str, name: str) -> str:
        """Half-split rope of x [B, T, heads, head_dim]: x * cos + (x @ P) * sin (see ``rope``)."""
        g, s = self.g, self.spec
        p = g.const(rotate_half_matrix(s.head_dim, s.rope.rotary_dim), "rotate_half")
        turned = g.op("Mul", [g.op("MatMul", [x, p], f"{name}_turn"), sin], f"{name}_sin")
        return g.op("Add", [g.op("Mul", [x, cos], f"{name}_cos"), turned], name)

    # -- the model -----------------------------------------------------------------
    def build(self) -> None:
        g, s, o = self.g, self.spec, self.opts
        kvdt = o.onnx_dtype
        g.input("input_ids", TensorProto.INT64, ["batch", "new_tokens"])
        g.input("position_ids", TensorProto.INT64, [3, "batch", "new_tokens"] if s.mrope else ["batch", "new_tokens"])
        g.input("context_lens", TensorProto.INT64, ["batch"])
        g.input("query_lens", TensorProto.INT64, ["batch"])
        g.input("block_tables", TensorProto.INT64, ["batch", "max_blocks"])
        g.input("logits_indices", TensorProto.INT64, ["batch", "num_logits"])
        if s.vision:
            g.input(names.IMAGE_EMBEDS, TensorProto.FLOAT, ["image_rows", s.hidden_size])
            g.input(names.IMAGE_INDEX, TensorProto.INT64, ["batch", "new_tokens"])
        if o.quant is not None and o.quant.switchable:
            g.input("quant_mask", TensorProto.FLOAT, [len(o.quant.switch_order)])
            g.input("scale_nudge", TensorProto.FLOAT, [])
            if o.quant.bias_correction:
                g.input("bias_mask", TensorProto.FLOAT, [len(o.quant.switch_order)])
        pool_dims: list[int | str] = [s.num_kv_heads, "num_blocks", "block_size", s.head_dim]  # kvcache.layout.POOL_LAYOUT
        for i in range(s.num_layers):
            g.input(names.past_key(i), kvdt, pool_dims)
            g.input(f"past_value.{i}", kvdt, pool_dims)

        # embedding (chunked: the largest tensor of a 9B model)
        emb_name = self.w.embedding_name()
        if self.int8_embedding():
            embed = ""  # the LM head reads the checkpoint's rows itself
            rows = partial(self.int8_embedding_rows, self.int8_embedding_table(emb_name))
        else:
            embed = g.weight_chunks("embed_tokens.weight", (s.vocab_size, s.hidden_size), self.wdt,
                                    row_chunks(lambda a, b: self.w.rows(emb_name, a, b), s.vocab_size,
                                               EMBED_CHUNK_ROWS))
            rows = partial(self.float_embedding_rows, embed)
        x = self.embed_tokens(rows)

        # rope tables gathered once by position
        cos_t, sin_t = full_width_tables(*cos_sin_tables(s.rope, o.max_seq_len, s.max_position_embeddings),
                                         s.head_dim)
        cos = g.op("Unsqueeze", [self.rope_rows(g.weight("rope.cos", cos_t), "cos"), g.ints([2])], "cos")
        sin = g.op("Unsqueeze", [self.rope_rows(g.weight("rope.sin", sin_t), "sin"), g.ints([2])], "sin")

        mask = self.attention_bias()
        for i in range(s.num_layers):
            x = self.layer(i, x, cos, sin, mask)
            if self.progress:
                self.progress(i + 1, s.num_layers)
        self.head(x, embed)

    def embed_tokens(self, rows: Callable[[str], str]) -> str:
        """``[B, T, hidden]`` float32 (named ``embed``): the tokens' embedding rows (``rows(name)``);
        with a vision tower, an image token's row of ``image_embeds`` instead where ``image_index``
        points at one."""
        g = self.g
        if not self.spec.vision:
            return rows("embed")
        tokens = rows("embed_tokens")
        images = g.op("Gather", [names.IMAGE_EMBEDS, names.IMAGE_INDEX], "embed_images", axis=0)
        is_image = g.op("Unsqueeze", [g.op("Greater", [names.IMAGE_INDEX, g.const(np.int64(0), "s0")], "image_tokens"),
                                      g.ints([2], "i2")], "image_tokens3")
        return g.op("Where", [is_image, images, tokens], "embed")

    def float_embedding_rows(self, embed: str, name: str) -> str:
        return self.to_f32(self.g.op("Gather", [embed, names.INPUT_IDS], name, axis=0))

    def int8_embedding(self) -> bool:
        q = self.opts.quant
        return (q is not None and q.weight_only and q.int8_embedding and "lm_head" in q.act_amax
                and self.spec.hidden_size % WEIGHT_BLOCK == 0)

    def int8_embedding_table(self, emb_name: str) -> tuple[str, str]:
        """The INT8 embedding (``quant.embedding_rows``), quantized chunk by chunk: (rows, scales)."""
        g, s = self.g, self.spec
        parts = [embedding_rows(self.w.rows(emb_name, a, min(a + EMBED_CHUNK_ROWS, s.vocab_size)))
                 for a in range(0, s.vocab_size, EMBED_CHUNK_ROWS)]
        q = g.weight_chunks("embed_tokens.weight_i8", (s.vocab_size, s.hidden_size), np.dtype(np.int8),
                            (p[0] for p in parts))
        return q, g.weight("embed_tokens.weight_scale", np.concatenate([p[1] for p in parts]))

    def int8_embedding_rows(self, table: tuple[str, str], name: str) -> str:
        """``[B, T, hidden]`` float32: the tokens' rows of the INT8 embedding, each block of
        ``WEIGHT_BLOCK`` values times its scale."""
        g, (q, scale) = self.g, table
        rows = g.op("Cast", [g.op("Gather", [q, names.INPUT_IDS], "embed_q", axis=0)], "embed_qf", to=TensorProto.FLOAT)
        blocks = g.op("Reshape", [rows, g.ints([0, 0, -1, WEIGHT_BLOCK], "embed_blocks_shape")], "embed_blocks")
        scaled = g.op("Mul", [blocks, g.op("Gather", [scale, names.INPUT_IDS], "embed_scale", axis=0)], "embed_scaled")
        return g.op("Reshape", [scaled, g.ints([0, 0, self.spec.hidden_size], "embed_shape")], name)

    def rope_rows(self, table: str, name: str) -> str:
        """``[B, T, head_dim]``: the table's rows at each token's position. With M-RoPE (3-D positions
        ``[3, B, T]``) each column is taken from the row of its section (temporal, height, width):
        the three gathers times a one-hot mask per column, summed, which picks each value exactly."""
        g, s = self.g, self.spec
        rows = g.op("Gather", [table, "position_ids"], f"{name}_pos", axis=0)
        if not s.mrope:
            return rows
        return g.op("ReduceSum", [g.op("Mul", [rows, g.const(mrope_masks(s), f"{name}_sections")], f"{name}_picked"),
                                  g.ints([0], "i0_axes")], f"{name}_mrope", keepdims=0)

    def attention_bias(self) -> str:
        """[1, B, 1, T, P+T] float32: 0 where a new token may attend, NEG_INF elsewhere.

        Also sets ``self.past_len``: P, as a 1-element int64 tensor.
        """
        g = self.g
        zero, one = g.ints([0], "i0"), g.ints([1], "i1")
        block_size = g.op("Gather", [g.op("Shape", [names.past_key(0)], "pool_shape"), g.ints([2], "i2")], "block_size")
        max_blocks = g.op("Gather", [g.op("Shape", ["block_tables"], "bt_shape"), one], "max_blocks")
        past_len = g.op("Mul", [max_blocks, block_size], "past_len")
        new_len = g.op("Gather", [g.op("Shape", ["input_ids"], "ids_shape"), one], "new_len")
        self.past_len = past_len
        scalar = lambda t, h: g.op("Squeeze", [t, zero], h)
        zero_s, one_s = g.const(np.int64(0), "s0"), g.const(np.int64(1), "s1")
        past_idx = g.op("Range", [zero_s, scalar(past_len, "past_len_s"), one_s], "past_idx")  # [P]
        new_idx = g.op("Range", [zero_s, scalar(new_len, "new_len_s"), one_s], "new_idx")  # [T]
        ctx = g.op("Unsqueeze", ["context_lens", one], "ctx_col")  # [B,1]
        past_ok = g.op("Unsqueeze", [g.op("Less", [past_idx, ctx], "past_ok2"), one], "past_ok")  # [B,1,P]
        causal = g.op("LessOrEqual", [new_idx, g.op("Unsqueeze", [new_idx, one], "q_col")], "causal")  # [T,T]
        qlen = g.op("Unsqueeze", ["query_lens", g.ints([1, 2], "i12")], "qlen")  # [B,1,1]
        in_query = g.op("Less", [new_idx, qlen], "in_query")  # [B,1,T]
        new_ok = g.op("And", [causal, in_query], "new_ok")  # [B,T,T]
        batch = g.op("Gather", [g.op("Shape", ["input_ids"], "ids_shape"), zero], "batch")
        past_full = g.op("Expand", [past_ok, g.op("Concat", [batch, new_len, past_len], "pm_shape", axis=0)], "past_full")
        ok = g.op("Concat", [past_full, new_ok], "attn_ok", axis=2)  # [B,T,P+T]
        bias = g.op("Where", [ok, g.const(np.float32(0.0), "f0"), g.const(np.float32(NEG_INF), "neg_inf")], "attn_bias3")
        return g.op("Unsqueeze", [bias, g.ints([0, 2], "i02")], "attn_bias")

    def layer(self, i: int, x: str, cos: str, sin: str, mask: str) -> str:
        g, s, w = self.g, self.spec, self.w
        p = names.layer(i)
        t = partial(names.in_layer, i)  # the names other code keys on (graph/names.py)
        h = self.rms_norm(x, w.norm(i, "input"), f"{p}.input_norm")
        qkv_w, qkv_b = w.qkv(i)
        qkv = self.linear(h, qkv_w, qkv_b, f"{p}.qkv")
        # q and k heads side by side get rope together, then split: fewer nodes per layer
        qk, v = g.op_n("Split", [qkv, g.ints([s.q_size + s.kv_size, s.kv_size])], t(names.QKV_SPLIT), 2, axis=-1)
        qk = g.op("Reshape", [qk, g.ints([0, 0, s.num_heads + s.num_kv_heads, s.head_dim])], f"{p}.qk")
        qk = self.rope(qk, cos, sin, f"{p}.qk_rope")
        q, k = g.op_n("Split", [qk, g.ints([s.num_heads, s.num_kv_heads])], f"{p}.qk_split", 2, axis=2)
        v = g.op("Reshape", [v, g.ints([0, 0, s.num_kv_heads, s.head_dim])], f"{p}.v")
        k_new = g.rename_output(self.to_compute(k), names.new_key(i))
        v_new = g.rename_output(self.to_compute(v), names.new_value(i))

        attn = self.paged_attention(i, q, k_new, v_new, mask)
        o_w, o_b = w.o_proj(i)
        attn = self.linear(attn, o_w, o_b, f"{p}.o_proj")
        if s.fam.sandwich_norms:
            attn = self.rms_norm(attn, w.norm(i, "post_attn"), f"{p}.post_attn_norm")
        x = g.op("Add", [x, attn], t(names.ATTN_RESIDUAL))

        h = self.rms_norm(x, w.norm(i, "mlp"), f"{p}.mlp_norm")
        gu = self.linear(h, w.gate_up(i), None, f"{p}.gate_up")
        gate, up = g.op_n("Split", [gu, g.ints([s.intermediate_size, s.intermediate_size])], f"{p}.gu_split", 2, axis=-1)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.sigmoid")], f"{p}.silu"), up], f"{p}.act")
        m = self.linear(act, w.down(i), None, f"{p}.down")
        if s.fam.sandwich_norms:
            m = self.rms_norm(m, w.norm(i, "post_mlp"), f"{p}.post_mlp_norm")
        return g.op("Add", [x, m], t(names.MLP_RESIDUAL))

    def paged_attention(self, i: int, q: str, k_new: str, v_new: str, mask: str) -> str:
        """Attention of the new tokens over their past (from the pool) and themselves.

        Shapes with H = kv_heads, G = query heads per KV head, P = past slots, T = new tokens:
        the past K/V come out of the Gather as [H, B, 1, P, hd], the layout MatMul needs, and are
        never copied. Scores are computed as K q^T ([H, B, G, P+T, T], past and new blocks joined,
        the small side) and turned to [.., T, P+T] for the softmax; the probabilities are split
        again and multiply past and new V separately.
        """
        g, s = self.g, self.spec
        p = names.layer(i)
        t = partial(names.in_layer, i)
        kvh, hd, grp = s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
        past5 = g.ints([0, 0, 1, -1, hd], "past5_shape")
        k_past = g.op("Reshape", [g.op("Gather", [names.past_key(i), names.BLOCK_TABLES], f"{p}.k_gather", axis=1), past5],
                      f"{p}.k_past")  # [H,B,1,P,hd]
        v_past = g.op("Reshape", [g.op("Gather", [names.past_value(i), names.BLOCK_TABLES], f"{p}.v_gather", axis=1), past5],
                      f"{p}.v_past")
        group_axis = g.ints([2], "i2")
        k_cur = g.op("Unsqueeze", [g.op("Transpose", [k_new], f"{p}.k_t", perm=[2, 0, 1, 3]), group_axis],
                     f"{p}.k_cur")  # [H,B,1,T,hd]
        v_cur = g.op("Unsqueeze", [g.op("Transpose", [v_new], f"{p}.v_t", perm=[2, 0, 1, 3]), group_axis],
                     f"{p}.v_cur")
        qg = g.op("Reshape", [self.to_compute(q), g.ints([0, 0, kvh, grp, hd], "q_group_shape")], t(names.Q_GROUPED))
        q_t = g.op("Transpose", [qg], t(names.Q_T), perm=[2, 0, 3, 4, 1])  # [H,B,G,hd,T] (scale folded in W_q)
        scores_t = g.op("Concat", [g.op("MatMul", [k_past, q_t], t(names.SCORES_PAST)),
                                   g.op("MatMul", [k_cur, q_t], t(names.SCORES_NEW))], t(names.SCORES_T), axis=3)
        scores = g.op("Transpose", [self.to_f32(scores_t)], t(names.SCORES), perm=[0, 1, 2, 4, 3])  # [H,B,G,T,P+T]
        probs = self.to_compute(g.op("Softmax", [g.op("Add", [scores, mask], t(names.MASKED))], t(names.PROBS), axis=-1))
        # Slice, not Split: split sizes from shape arithmetic are not accepted by every parser
        last, end = g.ints([-1], "axis_last"), g.ints([np.iinfo(np.int64).max], "to_end")
        p_past = g.op("Slice", [probs, g.ints([0], "i0"), self.past_len, last], t(names.PROBS_PAST))
        p_cur = g.op("Slice", [probs, self.past_len, end, last], t(names.PROBS_NEW))
        ctx = g.op("Add", [g.op("MatMul", [p_past, v_past], f"{p}.ctx_past"),
                           g.op("MatMul", [p_cur, v_cur], f"{p}.ctx_new")], f"{p}.context")  # [H,B,G,T,hd]
        ctx = g.op("Transpose", [ctx], f"{p}.ctx_t", perm=[1, 3, 0, 2, 4])  # [B,T,H,G,hd]
        return self.to_f32(g.op("Reshape", [ctx, g.ints([0, 0, s.q_size], "ctx_shape")], t(names.ATTN)))

    def head(self, x: str, embed: str) -> None:
        g, s, o = self.g, self.spec, self.opts
        idx = g.op("Unsqueeze", ["logits_indices", g.ints([2], "i2")], "logits_idx3")  # [B,K,1]
        idx_shape = g.op("Concat", [g.op("Shape", ["logits_indices"], "li_shape"), g.ints([s.hidden_size], "hid")],
                         "li_shape3", axis=0)
        idx = g.op("Expand", [idx, idx_shape], "logits_idx_e")  # [B,K,D]
        x = g.op("GatherElements", [x, idx], "logits_hidden", axis=1)  # [B,K,D]
        h = self.rms_norm(x, self.w.norm(None, "final"), "final_norm")
        head_name = self.w.lm_head_name()
        flat = g.op("Reshape", [h, g.ints([-1, s.hidden_size], "flat_shape")], "hidden_flat")
        src = head_name or self.w.embedding_name()
        if self.quantized("lm_head") and o.quant is not None and not o.quant.switchable and \
                s.vocab_size * s.hidden_size * 4 > LM_HEAD_STREAM_BYTES:
            # a large INT8 head (GLM-4's 151,552 x 4096 is 2.5 GB in float32): quantized in chunks of rows
            logits = self.to_f32(quantized_rows_matmul(g, flat, lambda a, b: self.w.rows(src, a, b), s.vocab_size,
                                                       s.hidden_size, "lm_head", o.quant, half=self.half()))
        elif self.quantized("lm_head"):
            # INT8 head: the [vocab, hidden] matrix as a [hidden, vocab] MatMul weight, per-vocab-row scales
            w = np.concatenate([np.asarray(self.w.rows(src, a, min(a + EMBED_CHUNK_ROWS, s.vocab_size)), np.float32)
                                for a in range(0, s.vocab_size, EMBED_CHUNK_ROWS)])
            logits = self.linear(flat, w.T, None, "lm_head", rank=2)
        else:
            if head_name is None:
                lm_head = embed
            else:
                lm_head = g.weight_chunks("lm_head.weight", (s.vocab_size, s.hidden_size), self.wdt,
                                          row_chunks(lambda a, b: self.w.rows(head_name, a, b), s.vocab_size,
                                                     EMBED_CHUNK_ROWS))
            logits = self.to_f32(g.op("Gemm", [self.to_compute(flat), lm_head], "logits_flat", transB=1))
        out_shape = g.op("Concat", [g.op("Shape", ["logits_indices"], "li_shape_b"), g.ints([s.vocab_size], "voc")],
                         "logits_shape", axis=0)
        g.rename_output(g.op("Reshape", [logits, out_shape], "logits_3d"), "logits")
        g.output("logits", TensorProto.FLOAT, ["batch", "num_logits", s.vocab_size])
        kvdt = o.onnx_dtype
        for i in range(s.num_layers):
            g.output(names.new_key(i), kvdt, ["batch", "new_tokens", s.num_kv_heads, s.head_dim])
            g.output(names.new_value(i), kvdt, ["batch", "new_tokens", s.num_kv_heads, s.head_dim])


def write_int8_graph(out_dir: Path, name: str, spec: ModelSpec, weights: WeightSource, plan: QuantPlan,
                     max_seq_len: int, dtype: str = "float32") -> Path:
    """``out_dir/name`` (+ ``name.data``): the decoder with the plan's linears in INT8 (or INT4).
    ``dtype`` float16 (TensorRT's form): the GEMMs with their Q/DQ, the attention and the KV cache in
    float16; norms, softmax, rope and the residual stream float32."""
    builder = GraphBuilder(out_dir / f"{name}.data")
    # blocked DequantizeLinear, and QuantizeLinear of float16, are opset 19+ (21: int4)
    opset = WEIGHT_ONLY_OPSET if plan.weight_only or dtype != "float32" else OPSET
    try:
        DecoderGraph(builder, spec, weights, GraphOptions(dtype, max_seq_len, plan, opset)).build()
        model = builder.model(f"{spec.family}_paged_decoder_int8", opset)
    finally:
        builder.close()
    onnx.save_model(model, str(out_dir / name))
    return out_dir / name


def mrope_masks(spec: ModelSpec) -> np.ndarray:
    """float32 ``[3, 1, 1, head_dim]``: which position row (temporal, height, width) turns each column
    of a full-width rope table (``full_width_tables``: the pairs' cos/sin, repeated for both halves,
    then the columns rope leaves alone, taken from row 0). Rotated pair j belongs to section k when
    it lies in the k-th run of ``mrope_section`` (transformers' ``recomposition_frequencies``)."""
    half = spec.rope.rotary_dim // 2
    section = np.repeat(np.arange(3), spec.mrope_section)  # [half]: each pair's section
    column = np.concatenate([section, section, np.zeros(spec.head_dim - 2 * half, np.int64)])
    return (column[None, :] == np.arange(3)[:, None]).astype(np.float32).reshape(3, 1, 1, spec.head_dim)
