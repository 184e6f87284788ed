"""autoglm-trt: export GLM- and Llama-family checkpoints to ONNX, calibrate, build engines, generate.

Importing the package is cheap: torch, transformers and TensorRT are imported only by the
functions that need them.
"""

__version__ = "0.1.0"
