"""The ``eval`` stage: perplexity and agreement with a reference (see ``perplexity``)."""

from .perplexity import evaluate, gate_failures, model_logits, score

__all__ = ["evaluate", "gate_failures", "model_logits", "score"]
