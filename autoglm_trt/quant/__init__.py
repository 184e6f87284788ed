"""Quantization maths, pure numpy: the plan, INT8 and INT4 rounding, GPTQ, Hadamard rotations and
the INT8 KV cache's scales. How a quantized linear is written into the graph is ``graph.qdq``."""
