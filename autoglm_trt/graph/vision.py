"""GLM-4.1V's vision encoder as an ONNX graph: one image's patches in, its merged embeddings out.

Inputs (one image a run, so its patches attend to each other alone)::

    pixel_values   float32 [patches, 3 * T * P * P]   model.image.preprocess, one image's rows
    pos_embed      float32 [patches, hidden]          model.vision.resampled_positions of its grid
    rope_cos       float32 [patches, head_dim]        model.vision.rope_tables of its grid
    rope_sin       float32 [patches, head_dim]

Output ``image_embeds`` float32 ``[patches / merge**2, text hidden]``: what replaces the image's
tokens in the decoder. As transformers' ``Glm4vVisionModel``: the patch embedding (its Conv3d as
one MatMul over a patch's row), RMSNorm, the resampled position embedding added, ``depth`` blocks
(RMSNorm, attention with the axial 2-D rope over the image's patches, RMSNorm, SiLU-gated MLP),
RMSNorm, the ``merge x merge`` downsample (its Conv2d as one MatMul over a block of patches, which
the processor emits consecutively), and the merger (linear, LayerNorm, GELU, SiLU-gated MLP).
The per-grid inputs are computed on the host (they depend on the grid, not the pixels).
Attention is ONNX Runtime's fused ``MultiHeadAttention`` (``ATTENTION_FORMS``): at a phone
screenshot's 12,432 patches the plain form holds ``heads x 12,432^2`` float scores (2.5 GB a
layer at 4 heads) and took most of the encoder's time (``benchmarks/bench_agent_images.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import TensorProto

from ..model.rope import rotate_half_matrix
from .builder import GraphBuilder

VISION_PREFIX = "model.visual."
VISION_GRAPH = "vision.onnx"  # the export's encoder graph, and its float32 form in an engine
VISION_POSITIONS = "vision_positions.npy"  # the encoder's learned position table [S * S, hidden]
OPSET = 17
MICROSOFT = "com.microsoft"
# "fused": ONNX Runtime's com.microsoft.MultiHeadAttention (flash attention on the CPU; the form the
# engine runs); "standard": MatMul, Softmax, MatMul in plain ONNX (TensorRT's form is
# ``graph.vision_trt``'s rewrite of the fused graph)
ATTENTION_FORMS = ("fused", "standard")


class VisionGraph:
    def __init__(self, g: GraphBuilder, read: Callable[[str], np.ndarray], has: Callable[[str], bool],
                 config: dict, attention: str = "fused"):
        if attention not in ATTENTION_FORMS:
            raise ValueError(f"attention must be one of {ATTENTION_FORMS}, got {attention!r}")
        self.g, self.read, self.has, self.attention_op = g, read, has, attention
        self.hidden = int(config["hidden_size"])
        self.heads = int(config.get("num_heads", config.get("num_attention_heads", 0)))
        self.depth = int(config.get("depth", config.get("num_hidden_layers", 0)))
        self.merge = int(config.get("spatial_merge_size", 2))
        self.eps = float(config.get("rms_norm_eps", 1e-5))
        self.head_dim = self.hidden // self.heads

    def w(self, name: str) -> np.ndarray:
        return np.asarray(self.read(VISION_PREFIX + name), np.float32)

    def linear(self, x: str, name: str) -> str:
        """x @ W^T (+ b) of the checkpoint's ``name`` (.weight [out, in], .bias if present)."""
        g = self.g
        w = self.w(f"{name}.weight")
        y = g.op("MatMul", [x, g.weight(f"visual.{name}.weight", np.ascontiguousarray(w.reshape(w.shape[0], -1).T))],
                 f"visual.{name}")
        if self.has(VISION_PREFIX + f"{name}.bias"):
            y = g.op("Add", [y, g.weight(f"visual.{name}.bias", self.w(f"{name}.bias"))], f"visual.{name}_bias")
        return y

    def rms_norm(self, x: str, name: str) -> str:
        g = self.g
        var = g.op("ReduceMean", [g.op("Mul", [x, x], f"visual.{name}_sq")], f"visual.{name}_var", axes=[-1], keepdims=1)
        std = g.op("Sqrt", [g.op("Add", [var, g.const(np.float32(self.eps), "visual_eps")])], f"visual.{name}_std")
        return g.op("Mul", [g.op("Div", [x, std], f"visual.{name}_div"),
                            g.weight(f"visual.{name}.weight", self.w(f"{name}.weight"))], f"visual.{name}")

    def gated_mlp(self, x: str, name: str) -> str:
        g = self.g
        gate = self.linear(x, f"{name}.gate_proj")
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"visual.{name}_sigmoid")], f"visual.{name}_silu")
        return self.linear(g.op("Mul", [silu, self.linear(x, f"{name}.up_proj")], f"visual.{name}_act"),
                           f"{name}.down_proj")

    def attention(self, x: str, i: int, cos: str, sin: str) -> str:
        g, h, d = self.g, self.heads, self.head_dim
        p = f"blocks.{i}.attn"
        qkv = g.op("Reshape", [self.linear(x, f"{p}.qkv"), g.ints([0, 3, h, d], "visual_qkv_shape")], f"visual.{p}_heads")
        turn = g.const(rotate_half_matrix(d, d), "visual_rotate_half")

        def part(k: int, rope: bool, transpose: bool = True) -> str:  # [heads, patches, head_dim]
            t = g.op("Gather", [qkv, g.const(np.int64(k), f"visual_k{k}")], f"visual.{p}_{'qkv'[k]}", axis=1)
            if rope:
                t = g.op("Add", [g.op("Mul", [t, cos], f"visual.{p}_{'qkv'[k]}_cos"),
                                 g.op("Mul", [g.op("MatMul", [t, turn], f"visual.{p}_{'qkv'[k]}_turn"), sin],
                                      f"visual.{p}_{'qkv'[k]}_sin")], f"visual.{p}_{'qkv'[k]}_rope")
            return g.op("Transpose", [t], f"visual.{p}_{'qkv'[k]}_t", perm=[1, 0, 2]) if transpose else t

        if self.attention_op == "fused":
            # ONNX Runtime's MultiHeadAttention: [1, patches, hidden] each, no mask, so its CPU kernel
            # runs flash attention and never holds the [heads, patches, patches] scores
            flat = g.ints([1, -1, self.hidden], "visual_mha_shape")
            q, k, v = (g.op("Reshape", [part(j, j < 2, transpose=False), flat], f"visual.{p}_{'qkv'[j]}3")
                       for j in range(3))
            ctx = g.op("MultiHeadAttention", [q, k, v], f"visual.{p}_mha", domain=MICROSOFT, num_heads=h)
            merged = g.op("Reshape", [ctx, g.ints([-1, self.hidden], "visual_hidden_rows")], f"visual.{p}_out")
            return self.linear(merged, f"{p}.proj")
        q, k, v = part(0, True), part(1, True), part(2, False)
        scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], f"visual.{p}_kt", perm=[0, 2, 1])],
                                   f"visual.{p}_scores"), g.const(np.float32(d ** -0.5), "visual_scale")],
                      f"visual.{p}_scaled")
        ctx = g.op("MatMul", [g.op("Softmax", [scores], f"visual.{p}_probs", axis=-1), v], f"visual.{p}_ctx")
        merged = g.op("Reshape", [g.op("Transpose", [ctx], f"visual.{p}_ctx_t", perm=[1, 0, 2]),
                                  g.ints([0, self.hidden], "visual_hidden_shape")], f"visual.{p}_out")
        return self.linear(merged, f"{p}.proj")

    def build(self) -> None:
        g = self.g
        g.input("pixel_values", TensorProto.FLOAT, ["patches", "patch_values"])
        g.input("pos_embed", TensorProto.FLOAT, ["patches", self.hidden])
        g.input("rope_cos", TensorProto.FLOAT, ["patches", self.head_dim])
        g.input("rope_sin", TensorProto.FLOAT, ["patches", self.head_dim])
        x = self.rms_norm(self.linear("pixel_values", "patch_embed.proj"), "post_conv_layernorm")
        x = g.op("Add", [x, "pos_embed"], "visual.embedded")
        axis1 = g.ints([1], "visual_axis1")
        cos = g.op("Unsqueeze", ["rope_cos", axis1], "visual.cos")  # [patches, 1, head_dim]
        sin = g.op("Unsqueeze", ["rope_sin", axis1], "visual.sin")
        for i in range(self.depth):
            x = g.op("Add", [x, self.attention(self.rms_norm(x, f"blocks.{i}.norm1"), i, cos, sin)],
                     f"visual.blocks.{i}.attn_residual")
            x = g.op("Add", [x, self.gated_mlp(self.rms_norm(x, f"blocks.{i}.norm2"), f"blocks.{i}.mlp")],
                     f"visual.blocks.{i}.mlp_residual")
        x = self.rms_norm(x, "post_layernorm")
        m = self.merge
        grouped = g.op("Reshape", [x, g.ints([-1, m * m, self.hidden], "visual_b")], "visual.blocks_of_patches")
        by_channel = g.op("Transpose", [grouped], "visual.blocks_t", perm=[0, 2, 1])  # [n, hidden, m * m]
        blocks = g.op("Reshape", [by_channel, g.ints([0, self.hidden * m * m], "visual_flat")], "visual.merge_rows")
        x = self.linear(blocks, "downsample")
        x = self.merger(x)
        g.rename_output(x, "image_embeds")
        g.output("image_embeds", TensorProto.FLOAT, ["tokens", self.w("merger.down_proj.weight").shape[0]])

    def merger(self, x: str) -> str:
        g = self.g
        x = self.linear(x, "merger.proj")
        mean = g.op("ReduceMean", [x], "visual.ln_mean", axes=[-1], keepdims=1)
        centred = g.op("Sub", [x, mean], "visual.ln_centred")
        var = g.op("ReduceMean", [g.op("Mul", [centred, centred], "visual.ln_sq")], "visual.ln_var", axes=[-1],
                   keepdims=1)
        normed = g.op("Div", [centred, g.op("Sqrt", [g.op("Add", [var, g.const(np.float32(1e-5), "visual_ln_eps")])],
                                                    "visual.ln_std")], "visual.ln_div")
        gamma = g.weight("visual.merger.ln.weight", self.w("merger.post_projection_norm.weight"))
        beta = g.weight("visual.merger.ln.bias", self.w("merger.post_projection_norm.bias"))
        x = g.op("Add", [g.op("Mul", [normed, gamma], "visual.ln_scaled"), beta], "visual.ln")
        erf = g.op("Erf", [g.op("Mul", [x, g.const(np.float32(1 / np.sqrt(2)), "visual_rsqrt2")], "visual.gelu_in")],
                   "visual.gelu_erf")
        x = g.op("Mul", [g.op("Mul", [x, g.const(np.float32(0.5), "visual_half")], "visual.gelu_half"),
                         g.op("Add", [erf, g.const(np.float32(1.0), "visual_one")], "visual.gelu_1p")], "visual.gelu")
        return self.gated_mlp(x, "merger")


def write_vision_graph(ckpt, out_dir, name: str = VISION_GRAPH, attention: str = "fused"):
    """``out_dir/name`` (+ ``name.data``): the vision encoder of an opened GLM-4.1V ``Checkpoint``
    (``attention``: one of ``ATTENTION_FORMS``)."""
    import onnx

    from ..errors import UnsupportedModelError

    config = ckpt.config.get("vision_config")
    if not isinstance(config, dict):
        raise UnsupportedModelError("the checkpoint's config.json has no vision_config")
    builder = GraphBuilder(out_dir / f"{name}.data")
    try:
        VisionGraph(builder, ckpt.read, ckpt.has, config, attention).build()
        model = builder.model("glm4v_vision_encoder", OPSET)
        if attention == "fused":
            model.opset_import.append(onnx.helper.make_opsetid(MICROSOFT, 1))
    finally:
        builder.close()
    onnx.save_model(model, str(out_dir / name))
    return out_dir / name
