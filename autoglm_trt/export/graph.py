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
    past_key.<i>   kv    [num_blocks, block_size, kv_heads, head_dim]   (read only)
    past_value.<i> kv    [num_blocks, block_size, kv_heads, head_dim]
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
Numerically sensitive parts (RMSNorm, rope, softmax, the residual stream, logits) are float32;
with ``dtype=float16`` the weights, GEMMs and the KV cache are float16. With a ``QuantPlan``
the planned linears get INT8 Q/DQ in TensorRT's explicit-quantization placement: a
QuantizeLinear/DequantizeLinear pair on the activation input of the MatMul (per-tensor scale)
and a DequantizeLinear on its INT8 weight (per-output-channel scale); norms, softmax,
residuals, embeddings and everything not planned stay in float.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from ..arch import ModelSpec
from ..onnx_builder import GraphBuilder, row_chunks
from ..rope import cos_sin_tables
from .weights import WeightSource

OPSET = 17
NEG_INF = -1.0e9  # finite, so a row with no valid key gives a uniform softmax, not NaN
EMBED_CHUNK_ROWS = 8192


@dataclass(frozen=True)
class QuantPlan:
    """INT8 plan: activation amax (absolute max after calibration) per linear, by name.

    With ``switchable`` (calibration's sensitivity search only), each planned linear computes
    both paths and a graph input ``quant_mask`` (float [len(switch_order)], 1 = INT8) picks
    one per linear, so many plans can be tried with one session.
    """

    act_amax: dict[str, float]
    switchable: bool = False

    @property
    def switch_order(self) -> list[str]:
        return sorted(n for n in self.act_amax if n != "lm_head")


@dataclass(frozen=True)
class GraphOptions:
    dtype: str = "float32"  # weights, GEMMs and KV cache: float32 | float16
    max_positions: int = 4096  # length of the rope tables = longest sequence the engine allows
    quant: QuantPlan | None = None

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def onnx_dtype(self) -> int:
        return TensorProto.FLOAT if self.dtype == "float32" else TensorProto.FLOAT16


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "position_ids", "context_lens", "query_lens", "block_tables", "logits_indices"]
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [f"past_key.{i}", f"past_value.{i}"]
        outputs += [f"new_key.{i}", f"new_value.{i}"]
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

    def linear(self, x: str, w: np.ndarray, b: np.ndarray | None, name: str) -> str:
        """float32 x -> MatMul in the weight dtype (+ bias) -> float32; INT8 Q/DQ if planned."""
        g = self.g
        quant = self.opts.quant
        if quant is not None and name in quant.act_amax:
            x_scale = g.const(np.float32(act_scale(quant.act_amax[name])), f"{name}.act_scale")
            zero = g.const(np.int8(0), "zero_i8")
            xq = g.op("QuantizeLinear", [x, x_scale, zero], f"{name}.act_q")
            xdq = g.op("DequantizeLinear", [xq, x_scale, zero], f"{name}.act_dq")
            wq, ws = quantize_weight_per_channel(w)
            wdq = g.op("DequantizeLinear", [g.weight(f"{name}.weight_i8", wq), g.weight(f"{name}.weight_scale", ws),
                                            g.weight(f"{name}.weight_zero", np.zeros(ws.shape, np.int8))],
                       f"{name}.weight_dq", axis=1)
            if quant.switchable:
                idx = g.const(np.int64(quant.switch_order.index(name)), f"{name}.switch_idx")
                on = g.op("Gather", ["quant_mask", idx], f"{name}.switch")
                xdq = g.op("Add", [x, g.op("Mul", [on, g.op("Sub", [xdq, x])])], f"{name}.switch_x")
                wdq = g.op("Where", [g.op("Greater", [on, g.const(np.float32(0.5), "half")]), wdq,
                                     g.weight(f"{name}.weight", w.astype(np.float32))], f"{name}.switch_w")
            y = g.op("MatMul", [xdq, wdq], name)
            if b is not None:
                y = g.op("Add", [y, g.weight(f"{name}.bias", b.astype(np.float32))], f"{name}_bias")
            return y
        y = g.op("MatMul", [self.to_compute(x), g.weight(f"{name}.weight", w.astype(self.wdt))], name)
        if b is not None:
            y = g.op("Add", [y, g.weight(f"{name}.bias", b.astype(self.wdt))], f"{name}_bias")
        return self.to_f32(y)

    def rms_norm(self, x: str, weight: np.ndarray, name: str) -> str:
        # Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul: the pattern ONNX Runtime fuses into
        # SimplifiedLayerNormalization and TensorRT into one normalization kernel.
        g = self.g
        sq = g.op("Pow", [x, g.const(np.float32(2.0), "two")], f"{name}_sq")
        var = g.op("ReduceMean", [sq], f"{name}_var", axes=[-1], keepdims=1)
        std = g.op("Sqrt", [g.op("Add", [var, g.const(np.float32(self.spec.rms_norm_eps), "eps")])], f"{name}_std")
        normed = g.op("Div", [x, std], f"{name}_div")
        return g.op("Mul", [normed, g.weight(f"{name}.weight", weight.astype(np.float32))], name)

    def rope(self, x: str, heads: int, cos: str, sin: str, name: str) -> str:
        """Half-split rope on the first rotary_dim dims of x [B, T, heads, head_dim]."""
        g, s = self.g, self.spec
        r, hd = s.rope.rotary_dim, s.head_dim
        if r == hd:
            x1, x2 = g.op_n("Split", [x, g.ints([r // 2, r // 2])], f"{name}_half", 2, axis=-1)
            passthrough = None
        else:
            x1, x2, passthrough = g.op_n("Split", [x, g.ints([r // 2, r // 2, hd - r])], f"{name}_part", 3, axis=-1)
        out1 = g.op("Sub", [g.op("Mul", [x1, cos]), g.op("Mul", [x2, sin])], f"{name}_r1")
        out2 = g.op("Add", [g.op("Mul", [x2, cos]), g.op("Mul", [x1, sin])], f"{name}_r2")
        parts = [out1, out2] + ([passthrough] if passthrough else [])
        return g.op("Concat", parts, name, axis=-1)

    # -- the model -----------------------------------------------------------------
    def build(self) -> None:
        g, s, o = self.g, self.spec, self.opts
        kvdt = o.onnx_dtype
        g.input("input_ids", TensorProto.INT64, ["batch", "new_tokens"])
        g.input("position_ids", TensorProto.INT64, ["batch", "new_tokens"])
        g.input("context_lens", TensorProto.INT64, ["batch"])
        g.input("query_lens", TensorProto.INT64, ["batch"])
        g.input("block_tables", TensorProto.INT64, ["batch", "max_blocks"])
        g.input("logits_indices", TensorProto.INT64, ["batch", "num_logits"])
        if o.quant is not None and o.quant.switchable:
            g.input("quant_mask", TensorProto.FLOAT, [len(o.quant.switch_order)])
        pool_shape: list[int | str] = ["num_blocks", "block_size", s.num_kv_heads, s.head_dim]
        for i in range(s.num_layers):
            g.input(f"past_key.{i}", kvdt, pool_shape)
            g.input(f"past_value.{i}", kvdt, pool_shape)

        # embedding (chunked: the largest tensor of a 9B model)
        emb_name = self.w.embedding_name()
        embed = g.weight_chunks("embed_tokens.weight", (s.vocab_size, s.hidden_size), self.wdt,
                                row_chunks(lambda a, b: self.w.rows(emb_name, a, b), s.vocab_size, EMBED_CHUNK_ROWS))
        x = self.to_f32(g.op("Gather", [embed, "input_ids"], "embed", axis=0))

        # rope tables gathered once by position
        cos_t, sin_t = cos_sin_tables(s.rope, o.max_positions, s.max_position_embeddings)
        cos = g.op("Unsqueeze", [g.op("Gather", [g.weight("rope.cos", cos_t), "position_ids"], "cos_pos", axis=0),
                                  g.ints([2])], "cos")
        sin = g.op("Unsqueeze", [g.op("Gather", [g.weight("rope.sin", sin_t), "position_ids"], "sin_pos", axis=0),
                                  g.ints([2])], "sin")

        mask = self.attention_bias()
        for i in range(s.num_layers):
            x = self.layer(i, x, cos, sin, mask)
            if self.progress:
                self.progress(i + 1, s.num_layers)
        self.head(x, embed)

    def attention_bias(self) -> str:
        """[B, 1, 1, T, P+T] float32: 0 where a new token may attend, NEG_INF elsewhere."""
        g = self.g
        zero, one = g.ints([0], "i0"), g.ints([1], "i1")
        block_size = g.op("Gather", [g.op("Shape", ["past_key.0"], "pool_shape"), g.ints([1], "i1")], "block_size")
        max_blocks = g.op("Gather", [g.op("Shape", ["block_tables"], "bt_shape"), one], "max_blocks")
        past_len = g.op("Mul", [max_blocks, block_size], "past_len")
        new_len = g.op("Gather", [g.op("Shape", ["input_ids"], "ids_shape"), one], "new_len")
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
        return g.op("Unsqueeze", [bias, g.ints([1, 2], "i12")], "attn_bias")

    def layer(self, i: int, x: str, cos: str, sin: str, mask: str) -> str:
        g, s, w = self.g, self.spec, self.w
        p = f"layers.{i}"
        h = self.rms_norm(x, w.norm(i, "input_layernorm"), f"{p}.input_norm")
        qkv_w, qkv_b = w.qkv(i)
        qkv = self.linear(h, qkv_w, qkv_b, f"{p}.qkv")
        q, k, v = g.op_n("Split", [qkv, g.ints([s.q_size, s.kv_size, s.kv_size])], f"{p}.qkv_split", 3, axis=-1)
        q = g.op("Reshape", [q, g.ints([0, 0, s.num_heads, s.head_dim])], f"{p}.q")
        k = g.op("Reshape", [k, g.ints([0, 0, s.num_kv_heads, s.head_dim])], f"{p}.k")
        v = g.op("Reshape", [v, g.ints([0, 0, s.num_kv_heads, s.head_dim])], f"{p}.v")
        q = self.rope(q, s.num_heads, cos, sin, f"{p}.q_rope")
        k = self.rope(k, s.num_kv_heads, cos, sin, f"{p}.k_rope")
        k_new = self.to_compute(k)
        v_new = self.to_compute(v)
        g.rename_output(k_new, f"new_key.{i}")
        g.rename_output(v_new, f"new_value.{i}")

        attn = self.paged_attention(i, q, k_new, v_new, mask)
        o_w, o_b = w.o_proj(i)
        attn = self.linear(attn, o_w, o_b, f"{p}.o_proj")
        if s.fam.sandwich_norms:
            attn = self.rms_norm(attn, w.norm(i, "post_self_attn_layernorm"), f"{p}.post_attn_norm")
        x = g.op("Add", [x, attn], f"{p}.attn_residual")

        h = self.rms_norm(x, w.norm(i, "post_attention_layernorm"), f"{p}.mlp_norm")
        gu = self.linear(h, w.gate_up(i), None, f"{p}.gate_up")
        gate, up = g.op_n("Split", [gu, g.ints([s.intermediate_size, s.intermediate_size])], f"{p}.gu_split", 2, axis=-1)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.sigmoid")], f"{p}.silu"), up], f"{p}.act")
        m = self.linear(act, w.down(i), None, f"{p}.down")
        if s.fam.sandwich_norms:
            m = self.rms_norm(m, w.norm(i, "post_mlp_layernorm"), f"{p}.post_mlp_norm")
        return g.op("Add", [x, m], f"{p}.mlp_residual")

    def paged_attention(self, i: int, q: str, k_new: str, v_new: str, mask: str) -> str:
        g, s = self.g, self.spec
        p = f"layers.{i}"
        kvh, hd, grp = s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
        past_shape = g.ints([0, -1, kvh, hd], "past_shape")
        k_past = g.op("Reshape", [g.op("Gather", [f"past_key.{i}", "block_tables"], f"{p}.k_gather", axis=0),
                                   past_shape], f"{p}.k_past")  # [B,P,kvh,hd]
        v_past = g.op("Reshape", [g.op("Gather", [f"past_value.{i}", "block_tables"], f"{p}.v_gather", axis=0),
                                   past_shape], f"{p}.v_past")
        keys = g.op("Concat", [k_past, k_new], f"{p}.keys", axis=1)  # [B,S,kvh,hd]
        values = g.op("Concat", [v_past, v_new], f"{p}.values", axis=1)
        # GQA without copying K/V: queries grouped per KV head, K/V broadcast over the group.
        qg = g.op("Reshape", [self.to_compute(q), g.ints([0, 0, kvh, grp, hd], "q_group_shape")], f"{p}.q_grouped")
        qg = g.op("Transpose", [qg], f"{p}.q_t", perm=[0, 2, 3, 1, 4])  # [B,kvh,grp,T,hd]
        kt = g.op("Unsqueeze", [g.op("Transpose", [keys], f"{p}.k_t", perm=[0, 2, 3, 1]), g.ints([2], "i2")],
                   f"{p}.k_t5")  # [B,kvh,1,hd,S]
        vt = g.op("Unsqueeze", [g.op("Transpose", [values], f"{p}.v_t", perm=[0, 2, 1, 3]), g.ints([2], "i2")],
                   f"{p}.v_t5")  # [B,kvh,1,S,hd]
        scores = self.to_f32(g.op("MatMul", [qg, kt], f"{p}.scores"))  # [B,kvh,grp,T,S] (scale folded in W_q)
        probs = g.op("Softmax", [g.op("Add", [scores, mask], f"{p}.masked")], f"{p}.probs", axis=-1)
        ctx = g.op("MatMul", [self.to_compute(probs), vt], f"{p}.context")  # [B,kvh,grp,T,hd]
        ctx = g.op("Transpose", [ctx], f"{p}.ctx_t", perm=[0, 3, 1, 2, 4])
        return self.to_f32(g.op("Reshape", [ctx, g.ints([0, 0, s.q_size], "ctx_shape")], f"{p}.attn"))

    def head(self, x: str, embed: str) -> None:
        g, s, o = self.g, self.spec, self.opts
        idx = g.op("Unsqueeze", ["logits_indices", g.ints([2], "i2")], "logits_idx3")  # [B,K,1]
        idx_shape = g.op("Concat", [g.op("Shape", ["logits_indices"], "li_shape"), g.ints([s.hidden_size], "hid")],
                         "li_shape3", axis=0)
        idx = g.op("Expand", [idx, idx_shape], "logits_idx_e")  # [B,K,D]
        x = g.op("GatherElements", [x, idx], "logits_hidden", axis=1)  # [B,K,D]
        h = self.rms_norm(x, self.w.norm(None, "norm"), "final_norm")
        head_name = self.w.lm_head_name()
        flat = g.op("Reshape", [h, g.ints([-1, s.hidden_size], "flat_shape")], "hidden_flat")
        quant = o.quant
        if quant is not None and "lm_head" in quant.act_amax:
            # INT8 head: per-row (output channel) scales of the [vocab, hidden] matrix, Gemm with transB.
            src = head_name or self.w.embedding_name()
            w = np.concatenate([np.asarray(self.w.rows(src, a, min(a + EMBED_CHUNK_ROWS, s.vocab_size)), np.float32)
                                for a in range(0, s.vocab_size, EMBED_CHUNK_ROWS)])
            wq, ws = quantize_weight_per_channel(w.T)
            x_scale = g.const(np.float32(act_scale(quant.act_amax["lm_head"])), "lm_head.act_scale")
            zero = g.const(np.int8(0), "zero_i8")
            xdq = g.op("DequantizeLinear", [g.op("QuantizeLinear", [flat, x_scale, zero], "lm_head.act_q"), x_scale, zero],
                       "lm_head.act_dq")
            wdq = g.op("DequantizeLinear", [g.weight("lm_head.weight_i8", np.ascontiguousarray(wq.T)),
                                            g.weight("lm_head.weight_scale", ws),
                                            g.weight("lm_head.weight_zero", np.zeros(ws.shape, np.int8))],
                       "lm_head.weight_dq", axis=0)
            logits = g.op("Gemm", [xdq, wdq], "logits_flat", transB=1)
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
            g.output(f"new_key.{i}", kvdt, ["batch", "new_tokens", s.num_kv_heads, s.head_dim])
            g.output(f"new_value.{i}", kvdt, ["batch", "new_tokens", s.num_kv_heads, s.head_dim])


def act_scale(amax: float) -> float:
    """Symmetric INT8 scale of an activation whose calibrated absolute max is ``amax``."""
    return max(float(amax), 1e-8) / 127.0


def quantize_weight_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel INT8 of a ``[in, out]`` matrix: (int8 weights, float32 scales)."""
    amax = np.max(np.abs(w), axis=0).astype(np.float32)
    scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale
