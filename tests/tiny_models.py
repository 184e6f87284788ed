"""Tiny random checkpoints of each supported family, made from transformers configs (fixed seed)."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1)

FAMILIES = {
    # Llama: half-split rope, separate gate/up, no biases; tied embeddings as in SmolLM2.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0, tie_word_embeddings=True)),
    # GLM-4-9B style: partial interleaved rope, fused gate_up_proj, QKV bias, GQA.
    "glm": ("GlmConfig", "GlmForCausalLM", dict(attention_bias=True, head_dim=16, partial_rotary_factor=0.5,
                                                 pad_token_id=0, eos_token_id=[1, 2])),
    # GLM-4-0414: as GLM plus post-attention and post-MLP norms.
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(attention_bias=True, head_dim=16, partial_rotary_factor=0.5,
                                                    pad_token_id=0, eos_token_id=[1, 2])),
    # GLM-4.1V (AutoGLM-Phone-9B's architecture): a GLM-4-0414 decoder with M-RoPE, an mrope_section
    # other than the 9B's [8, 12, 12], a small vision tower; GLM-4.1V's special tokens past the byte
    # vocabulary, <|endoftext|> and <|user|> its end tokens (GLM's)
    "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration", dict(head_dim=16, eos_token_id=[267, 265])),
}
GLM4V_TOKENS = dict(image_start_token_id=257, image_end_token_id=258, image_token_id=259, video_start_token_id=260,
                    video_end_token_id=261, video_token_id=262)
# the tiny GLM-4.1V tokenizer's special tokens, ids 256 on (the image and video ones at GLM4V_TOKENS' ids)
GLM4V_SPECIALS = ["[gMASK]", "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>",
                  "<|end_of_video|>", "<|video|>", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>"]
# GLM-4.1V's chat template conventions (zai-org's chat_template.jinja): [gMASK]<sop>, role tokens, and an
# image part rendered as <|begin_of_image|><|image|><|end_of_image|> where it stands among the text
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for item in m.content %}{% if item.type == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item.type == 'text' %}{{ item.text }}{% endif %}{% endfor %}{% endif %}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# small images for the tests: resized into [56 x 56, 224 x 224] pixels (transformers counts the
# temporal factor 2 in the area), so at most 64 image tokens
GLM4V_PREPROCESSOR = {"image_processor_type": "Glm4vImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
                      "merge_size": 2, "size": {"shortest_edge": 2 * 56 * 56, "longest_edge": 2 * 224 * 224},
                      "image_mean": [0.48145466, 0.4578275, 0.40821073],
                      "image_std": [0.26862954, 0.26130258, 0.27577711]}


def make_tiny_checkpoint(family: str, out_dir: Path, seed: int = 0, vision: dict | None = None,
                         preprocessor: dict | None = None, **overrides) -> Path:
    """A random checkpoint of a family (``overrides`` change the config, e.g. a larger model; for
    glm4v ``vision`` the vision config's fields and ``preprocessor`` preprocessor_config.json's)."""
    import torch
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    if family == "glm4v":
        section = overrides.pop("mrope_section", [1, 2, 1])
        text = {**COMMON, **extra, "vocab_size": 256 + len(GLM4V_SPECIALS), **overrides,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                    "mrope_section": section}}
        tower = {**dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, spatial_merge_size=2, patch_size=14,
                        temporal_patch_size=2, image_size=56, out_hidden_size=text["hidden_size"]), **(vision or {})}
        config = transformers.Glm4vConfig(text_config=text, vision_config=tower, **GLM4V_TOKENS,
                                          tie_word_embeddings=False)
    else:
        config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # random norms, so that a missed or misplaced norm is visible
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = byte_level_tokenizer()
    if family == "glm4v":
        import json

        tok.add_special_tokens(GLM4V_SPECIALS)
        (Path(out_dir) / "chat_template.jinja").write_text(GLM4V_CHAT_TEMPLATE)
        (Path(out_dir) / "preprocessor_config.json").write_text(json.dumps({**GLM4V_PREPROCESSOR, **(preprocessor or {})}))
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    return out_dir


def byte_level_tokenizer():
    """A 256-token byte-level tokenizer (every byte is a token), matching the tiny vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def bfloat16_copy(src: Path, out_dir: Path) -> Path:
    """The text checkpoint ``src`` saved in bfloat16, its magnitudes that float16 keeps only as
    subnormals lifted to 1e-4 (so each value is a float16 normal too), with its tokenizer."""
    import shutil

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.where(p.abs() < 1e-4, torch.full_like(p, 1e-4) * p.sign().add(0.5).sign(), p))
    model.save_pretrained(out_dir, safe_serialization=True)
    shutil.copy(Path(src) / "tokenizer.json", out_dir)
    return out_dir
