"""Engine build: a checkpoint or export -> ``engines/<name>/`` for ONNX Runtime or TensorRT."""
