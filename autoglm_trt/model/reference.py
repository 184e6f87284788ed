"""The transformers reference: a checkpoint's float32 logits, for parity and accuracy checks.

Input: a Hugging Face checkpoint directory. Output: a function from token windows
``int64 [batch, seq_len]`` to logits ``float32 [batch, seq_len, vocab]``. Needs torch and
transformers (the ``test`` extra); no code from the checkpoint is run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import require

Logits = Callable[[np.ndarray], np.ndarray]


def hf_logits(checkpoint: Path, allow_pickle: bool = False) -> Logits:
    """Logits function of a checkpoint in transformers, float32 (no remote code)."""
    torch = require("torch", "torch==2.13.0", "A transformers reference")
    transformers = require("transformers", "autoglm-trt[test]", "A transformers reference")
    model = transformers.AutoModelForCausalLM.from_pretrained(  # type: ignore[attr-defined]
        str(checkpoint), dtype=torch.float32, trust_remote_code=False,  # type: ignore[attr-defined]
        use_safetensors=not allow_pickle)
    model.eval()

    def fn(windows: np.ndarray) -> np.ndarray:
        with torch.no_grad():  # type: ignore[attr-defined]
            return model(torch.from_numpy(windows)).logits.float().numpy()  # type: ignore[attr-defined]

    return fn
