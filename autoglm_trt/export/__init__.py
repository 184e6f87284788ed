"""Export a Hugging Face checkpoint to a paged-KV ONNX graph (see ``pipeline.export_checkpoint``)."""
