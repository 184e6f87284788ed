"""Checkpoint tensors -> the fused, transposed tensors the graph uses.

Input: a ``Checkpoint`` and its ``ModelSpec``. Output: per layer, one Q/K/V matrix, one
gate/up matrix, the output and down projections (all ``[in, out]`` for ``MatMul``), the norm
weights, the embedding and the LM head. Export-time rewrites happen here:

* Q, K and V are concatenated into one matrix (one GEMM instead of three); gate and up too.
* For interleaved-rope families (GLM) the rows of W_q and W_k are permuted so that the graph
  uses half-split rope for every family (see ``rope.interleaved_to_half_order``).
* The attention scale 1/sqrt(head_dim) is folded into W_q and its bias.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..arch import ModelSpec
from ..checkpoint import Checkpoint
from ..errors import CheckpointError
from ..rope import interleaved_to_half_order


class WeightSource(Protocol):
    """What the graph builder asks for; ``WeightReader`` answers from a checkpoint,
    ``calib.exported_weights.ExportedWeights`` from a float32 export."""

    def norm(self, i: int | None, which: str) -> np.ndarray: ...
    def qkv(self, i: int) -> tuple[np.ndarray, np.ndarray | None]: ...
    def o_proj(self, i: int) -> tuple[np.ndarray, np.ndarray | None]: ...
    def gate_up(self, i: int) -> np.ndarray: ...
    def down(self, i: int) -> np.ndarray: ...
    def embedding_name(self) -> str: ...
    def lm_head_name(self) -> str | None: ...
    def rows(self, name: str, start: int, stop: int) -> np.ndarray: ...


class WeightReader:
    def __init__(self, ckpt: Checkpoint, spec: ModelSpec):
        self.ckpt = ckpt
        self.spec = spec
        self._prefix = "model." if ckpt.has("model.embed_tokens.weight") else ""
        if not ckpt.has(self._prefix + "embed_tokens.weight"):
            raise CheckpointError(
                f"{ckpt.path}: no embed_tokens.weight (looked for 'model.embed_tokens.weight' and "
                "'embed_tokens.weight'); the weights do not belong to a supported architecture"
            )

    # -- names -----------------------------------------------------------------
    def name(self, short: str) -> str:
        return self._prefix + short

    def layer(self, i: int, short: str) -> str:
        return f"{self._prefix}layers.{i}.{short}"

    def _get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        arr = self.ckpt.read(name)
        if tuple(arr.shape) != shape:
            raise CheckpointError(
                f"{self.ckpt.path}: tensor '{name}' has shape {list(arr.shape)}, expected {list(shape)} "
                "from config.json; the config and the weights do not match"
            )
        return arr.astype(np.float32, copy=False)

    def _maybe(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        return self._get(name, shape) if self.ckpt.has(name) else None

    # -- tensors ---------------------------------------------------------------
    def norm(self, i: int | None, which: str) -> np.ndarray:
        name = self.name("norm.weight") if i is None else self.layer(i, f"{which}.weight")
        return self._get(name, (self.spec.hidden_size,))

    def qkv(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Fused ``[hidden, q + 2*kv]`` matrix and its bias (or None)."""
        s = self.spec
        d = s.hidden_size
        mats, biases = [], []
        for proj, rows in (("q_proj", s.q_size), ("k_proj", s.kv_size), ("v_proj", s.kv_size)):
            w = self._get(self.layer(i, f"self_attn.{proj}.weight"), (rows, d))
            b = self._maybe(self.layer(i, f"self_attn.{proj}.bias"), (rows,))
            if proj != "v_proj":
                w, b = self._rope_order(w), (None if b is None else self._rope_order(b))
            if proj == "q_proj":
                scale = np.float32(1.0 / np.sqrt(s.head_dim))
                w = w * scale
                b = None if b is None else b * scale
            mats.append(w)
            biases.append(b if b is not None else np.zeros(rows, np.float32))
        has_bias = any(self.ckpt.has(self.layer(i, f"self_attn.{p}.bias")) for p in ("q_proj", "k_proj", "v_proj"))
        w_all = np.concatenate(mats, axis=0).T
        return w_all, (np.concatenate(biases) if has_bias else None)

    def o_proj(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        s = self.spec
        w = self._get(self.layer(i, "self_attn.o_proj.weight"), (s.hidden_size, s.q_size))
        return w.T, self._maybe(self.layer(i, "self_attn.o_proj.bias"), (s.hidden_size,))

    def gate_up(self, i: int) -> np.ndarray:
        s = self.spec
        if s.fam.gate_up_fused:
            w = self._get(self.layer(i, "mlp.gate_up_proj.weight"), (2 * s.intermediate_size, s.hidden_size))
        else:
            shape = (s.intermediate_size, s.hidden_size)
            w = np.concatenate([self._get(self.layer(i, "mlp.gate_proj.weight"), shape),
                                self._get(self.layer(i, "mlp.up_proj.weight"), shape)], axis=0)
        return w.T

    def down(self, i: int) -> np.ndarray:
        s = self.spec
        return self._get(self.layer(i, "mlp.down_proj.weight"), (s.hidden_size, s.intermediate_size)).T

    def embedding_name(self) -> str:
        return self.name("embed_tokens.weight")

    def lm_head_name(self) -> str | None:
        """Name of a separate LM head, or None when it is tied to the embedding."""
        if self.ckpt.has("lm_head.weight"):
            return "lm_head.weight"
        if self.spec.tie_word_embeddings:
            return None
        raise CheckpointError(f"{self.ckpt.path}: no lm_head.weight and tie_word_embeddings is false")

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of a ``[vocab, hidden]`` matrix (embedding or LM head)."""
        shape = self.ckpt.shape(name)
        expected = (self.spec.vocab_size, self.spec.hidden_size)
        if tuple(shape) != expected:
            raise CheckpointError(
                f"{self.ckpt.path}: tensor '{name}' has shape {list(shape)}, expected {list(expected)}"
            )
        return self.ckpt.read(name, slice(start, stop))

    def _rope_order(self, w: np.ndarray) -> np.ndarray:
        s = self.spec
        if not s.fam.rope_interleaved:
            return w
        order = interleaved_to_half_order(s.head_dim, s.rope.rotary_dim)
        heads = w.shape[0] // s.head_dim
        per_head = w.reshape(heads, s.head_dim, *w.shape[1:])
        return per_head[:, order].reshape(w.shape)
