"""The runtime: ``from autoglm_trt.runtime import Engine, SamplingParams``."""

from .engine import Engine, GenerationResult, RequestError
from .sampling import SamplingError, SamplingParams

__all__ = ["Engine", "GenerationResult", "RequestError", "SamplingError", "SamplingParams"]
