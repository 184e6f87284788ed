"""The runtime: ``from autoglm_trt.runtime import Engine, SamplingParams``."""

from .engine import Choice, Engine, GenerationResult, ImageOptions, RequestError
from .guided import Guide
from .sampling import SamplingError, SamplingParams

__all__ = [
    "Choice", "Engine", "GenerationResult", "Guide", "ImageOptions", "RequestError", "SamplingError", "SamplingParams",
]
