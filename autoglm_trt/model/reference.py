"""The transformers reference: a checkpoint's float32 logits, for parity and accuracy checks.

Input: a Hugging Face checkpoint directory. Output: a function from token windows
``int64 [batch, seq_len]`` (and, for an M-RoPE model, optionally its 3-D positions
``[3, batch, seq_len]``) to logits ``float32 [batch, seq_len, vocab]``. Needs torch and
transformers (the ``test`` extra); no code from the checkpoint is run. An image-text model
(GLM-4.1V) is loaded as one (``AutoModelForImageTextToText``) and given text alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import require

Logits = Callable[..., np.ndarray]


IMAGE_TEXT_MODEL_TYPES = ("glm4v",)


def hf_logits(checkpoint: Path, allow_pickle: bool = False) -> Logits:
    """Logits function of a checkpoint in transformers, float32 (no remote code)."""
    import json

    torch = require("torch", "torch==2.13.0", "A transformers reference")
    transformers = require("transformers", "autoglm-trt[test]", "A transformers reference")
    config = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
    auto = (transformers.AutoModelForImageTextToText if config.get("model_type") in IMAGE_TEXT_MODEL_TYPES  # type: ignore[attr-defined]
            else transformers.AutoModelForCausalLM)  # type: ignore[attr-defined]
    model = auto.from_pretrained(str(checkpoint), dtype=torch.float32, trust_remote_code=False,  # type: ignore[attr-defined]
                                 use_safetensors=not allow_pickle)
    model.eval()

    def fn(windows: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        extra = {} if positions is None else {"position_ids": torch.from_numpy(positions)}  # type: ignore[attr-defined]
        with torch.no_grad():  # type: ignore[attr-defined]
            return model(torch.from_numpy(windows), **extra).logits.float().numpy()  # type: ignore[attr-defined]

    return fn
