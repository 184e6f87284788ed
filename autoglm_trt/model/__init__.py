"""Model input: per-family specs (sizes, rope, Hugging Face tensor names), the checkpoint and
safetensors readers, the tokenized text, and the transformers reference. Nothing here knows
about ONNX; everything above reads models through this package."""
