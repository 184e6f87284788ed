"""Triton Inference Server deployment: ``repository`` writes a model repository whose Python
backend model (``model_template.py``) serves an engine; ``launcher`` starts tritonserver on it."""
