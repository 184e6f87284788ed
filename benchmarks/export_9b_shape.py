#!/usr/bin/env python3
"""Show that export memory does not grow with model size: a GLM-4-9B- or GLM-4.1V-9B-shaped checkpoint.

Writes a synthetic checkpoint with random bf16 weights in the shape of GLM-4-9B (40 layers,
hidden 4096, 32 heads, 2 KV heads, FFN 13696, vocab 151552; ~18.8 GB in 4 shards) or, with
``--model glm4v``, of GLM-4.1V-9B (AutoGLM-Phone-9B's architecture: the same decoder with
post-attention and post-MLP norms and M-RoPE [8, 12, 12], and a 24-layer vision tower of width
1536; its tensors' names and shapes from transformers' ``Glm4vForConditionalGeneration`` built on
the meta device), exports it to float16 ONNX with ``autoglm-trt export --dtype float16
--no-validate`` in a child process (the vision encoder in float32 beside it), and prints the
export's wall time and peak RSS (from ``getrusage`` of the child).

    python -m benchmarks.export_9b_shape [--model glm|glm4v] [--work /tmp/glm9b] [--keep]

Needs ~38 GB of free disk (~45 GB for glm4v). Not a CI test: it takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from autoglm_trt.model.safetensors import float32_to_bf16_bits

CONFIG = {
    "architectures": ["GlmForCausalLM"], "model_type": "glm", "vocab_size": 151552, "hidden_size": 4096,
    "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
    "head_dim": 128, "attention_bias": True, "hidden_act": "silu", "rms_norm_eps": 1.5625e-07,
    "max_position_embeddings": 131072, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329,
}
# GLM-4.1V-9B: the decoder of GLM-4-0414-9B with M-RoPE, transformers' default vision tower, and
# GLM-4.1V's special token ids (zai-org/GLM-4.1V-9B-Thinking config.json)
GLM4V_CONFIG = {
    "architectures": ["Glm4vForConditionalGeneration"], "model_type": "glm4v", "tie_word_embeddings": False,
    "image_start_token_id": 151339, "image_end_token_id": 151340, "video_start_token_id": 151341,
    "video_end_token_id": 151342, "image_token_id": 151343, "video_token_id": 151344,
    "text_config": {
        "model_type": "glm4v_text", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
        "attention_bias": True, "hidden_act": "silu", "rms_norm_eps": 1e-05, "max_position_embeddings": 65536,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [8, 12, 12]},
        "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329},
    "vision_config": {"model_type": "glm4v_vision", "depth": 24, "hidden_size": 1536, "intermediate_size": 13696,
                      "num_heads": 12, "out_hidden_size": 4096, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "image_size": 336, "hidden_act": "silu", "rms_norm_eps": 1e-05},
}
SHARD_BYTES = 5 * 1024**3
CHUNK = 16 * 1024 * 1024  # values generated at a time


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.q_proj.bias", (q,)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "mlp.gate_up_proj.weight", (2 * f, h)),
                (p + "mlp.down_proj.weight", (h, f))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def glm4v_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of a Glm4vForConditionalGeneration of config ``c``, as transformers names them
    (built on the meta device: no memory)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.Glm4vForConditionalGeneration(transformers.Glm4vConfig(**c))
    return [(name, tuple(p.shape)) for name, p in model.state_dict().items()]


def write_checkpoint(out: Path, config: dict, shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * 2
        if size + n > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in shard:
            n = int(np.prod(shape)) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * ((-len(raw)) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in shard:
                total = int(np.prod(shape))
                norm = name.endswith("norm.weight") or "layernorm" in name
                for start in range(0, total, CHUNK):
                    n = min(CHUNK, total - start)
                    vals = (1.0 + 0.05 * rng.standard_normal(n, np.float32)) if norm else \
                        0.02 * rng.standard_normal(n, np.float32)
                    f.write(float32_to_bf16_bits(vals).tobytes())
        print(f"  wrote {fname} ({(out / fname).stat().st_size / 1e9:.2f} GB)", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("glm", "glm4v"), default="glm")
    ap.add_argument("--work", type=Path, default=Path("/tmp/glm9b"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and export afterwards")
    args = ap.parse_args()
    ckpt, export = args.work / "checkpoint", args.work / "export"
    if not (ckpt / "model.safetensors.index.json").is_file():
        print(f"writing synthetic {args.model}-9B-shaped checkpoint to {ckpt}", flush=True)
        t = time.perf_counter()
        if args.model == "glm4v":
            write_checkpoint(ckpt, GLM4V_CONFIG, glm4v_shapes(GLM4V_CONFIG))
        else:
            write_checkpoint(ckpt, CONFIG, tensor_shapes(CONFIG))
        print(f"  {time.perf_counter() - t:.0f} s", flush=True)
    ckpt_gb = sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) / 1e9
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "autoglm_trt", "export", str(ckpt), "-o", str(export), "--dtype", "float16",
           "--no-validate", "--force"]
    proc = subprocess.run(cmd)
    wall = time.perf_counter() - t
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    if proc.returncode != 0:
        sys.exit(f"export failed with exit code {proc.returncode}")
    data_gb = (export / "model.onnx.data").stat().st_size / 1e9
    vision = export / "vision.onnx.data"
    largest = 151552 * 4096 * 2 / 1e9
    print(json.dumps({"model": args.model, "checkpoint_gb": round(ckpt_gb, 2), "onnx_data_gb": round(data_gb, 2),
                      "vision_data_gb": round(vision.stat().st_size / 1e9, 2) if vision.is_file() else None,
                      "export_seconds": round(wall, 1), "peak_rss_gb": round(peak_gb, 2),
                      "largest_tensor_gb": round(largest, 2),
                      "goal_peak_rss_gb": round(1.5 + largest, 2)}, indent=2))
    if not args.keep:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
