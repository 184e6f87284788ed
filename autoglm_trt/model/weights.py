"""Checkpoint tensors -> the fused, transposed tensors the graph uses.

Input: a ``Checkpoint`` and its ``ModelSpec``. Output: per layer, one Q/K/V matrix, one
gate/up matrix, the output and down projections (all ``[in, out]`` for ``MatMul``), the norm
weights, the embedding and the LM head. Export-time rewrites happen here:

* Q, K and V are concatenated into one matrix (one GEMM instead of three); gate and up too.
* For interleaved-rope families (GLM) the rows of W_q and W_k are permuted so that the graph
  uses half-split rope for every family (see ``rope.interleaved_to_half_order``).
* The attention scale 1/sqrt(head_dim) is folded into W_q and its bias.

The checkpoint's tensor names come from the family's ``TensorNames``; the graph asks for
norms by role (``spec.NORM_ROLES``, or ``None`` for the final norm), never by HF name.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..errors import CheckpointError
from .checkpoint import Checkpoint
from .rope import interleaved_to_half_order
from .spec import ModelSpec


class WeightSource(Protocol):
    """What the graph builder asks for; ``WeightReader`` answers from a checkpoint,
    ``calib.exported_weights.ExportedWeights`` from a float32 export."""

    def norm(self, i: int | None, role: str) -> np.ndarray:
        """Layer i's norm weight of a role in ``NORM_ROLES``; the final norm when i is None."""
        ...
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
        self.names = spec.fam.names
        tried = [self.names.embedding.format(p=p) for p in self.names.prefixes]
        found = [p for p, name in zip(self.names.prefixes, tried) if ckpt.has(name)]
        if not found:
            raise CheckpointError(
                f"{ckpt.path}: no embedding (looked for {', '.join(repr(t) for t in tried)}); the weights do not "
                "belong to a supported architecture"
            )
        self._prefix = found[0]

    # -- names -----------------------------------------------------------------
    def _attn(self, i: int, proj: str, what: str) -> str:
        return self.names.attention.format(p=self._prefix, i=i, proj=proj) + f".{what}"

    def _mlp(self, template: str, i: int) -> str:
        return template.format(p=self._prefix, i=i)

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
    def norm(self, i: int | None, role: str) -> np.ndarray:
        return self._get(self.names.norm(self._prefix, i, role), (self.spec.hidden_size,))

    def qkv(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Fused ``[hidden, q + 2*kv]`` matrix and its bias (or None)."""
        s = self.spec
        d = s.hidden_size
        mats, biases = [], []
        for proj, rows in (("q_proj", s.q_size), ("k_proj", s.kv_size), ("v_proj", s.kv_size)):
            w = self._get(self._attn(i, proj, "weight"), (rows, d))
            b = self._maybe(self._attn(i, proj, "bias"), (rows,))
            if proj != "v_proj":
                w, b = self._rope_order(w), (None if b is None else self._rope_order(b))
            if proj == "q_proj":
                scale = np.float32(1.0 / np.sqrt(s.head_dim))
                w = w * scale
                b = None if b is None else b * scale
            mats.append(w)
            biases.append(b if b is not None else np.zeros(rows, np.float32))
        has_bias = any(self.ckpt.has(self._attn(i, p, "bias")) for p in ("q_proj", "k_proj", "v_proj"))
        w_all = np.concatenate(mats, axis=0).T
        return w_all, (np.concatenate(biases) if has_bias else None)

    def o_proj(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        s = self.spec
        w = self._get(self._attn(i, "o_proj", "weight"), (s.hidden_size, s.q_size))
        return w.T, self._maybe(self._attn(i, "o_proj", "bias"), (s.hidden_size,))

    def gate_up(self, i: int) -> np.ndarray:
        s = self.spec
        if s.fam.gate_up_fused:
            w = self._get(self._mlp(self.names.gate_up, i), (2 * s.intermediate_size, s.hidden_size))
        else:
            shape = (s.intermediate_size, s.hidden_size)
            w = np.concatenate([self._get(self._mlp(self.names.gate, i), shape),
                                self._get(self._mlp(self.names.up, i), shape)], axis=0)
        return w.T

    def down(self, i: int) -> np.ndarray:
        s = self.spec
        return self._get(self._mlp(self.names.down, i), (s.hidden_size, s.intermediate_size)).T

    def embedding_name(self) -> str:
        return self.names.embedding.format(p=self._prefix)

    def lm_head_name(self) -> str | None:
        """Name of a separate LM head, or None when it is tied to the embedding."""
        name = self.names.lm_head.format(p=self._prefix)
        if self.ckpt.has(name):
            return name
        if self.spec.tie_word_embeddings:
            return None
        raise CheckpointError(f"{self.ckpt.path}: no {name} and tie_word_embeddings is false")

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
