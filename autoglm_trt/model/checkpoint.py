"""Open a Hugging Face checkpoint directory without torch.

Input: a directory with ``config.json``, safetensors weights (one file, or shards listed by
``model.safetensors.index.json``) and tokenizer files. Output: a ``Checkpoint`` that answers
the config, the names and shapes of its tensors, and reads one tensor at a time.

Pickled weights (``pytorch_model*.bin``) are refused unless the caller passes
``allow_pickle=True``; even then they are loaded with ``torch.load(weights_only=True)``.
No code from the checkpoint is ever run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import CheckpointError
from .safetensors import SafetensorsFile


class _TensorSource(Protocol):
    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str, rows: slice | None = None) -> np.ndarray: ...


class _SafetensorsSource:
    def __init__(self, files: list[Path]):
        self.files = [SafetensorsFile(p) for p in files]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                self._where[name] = f

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].tensors[name].shape

    def dtype(self, name: str) -> str:
        return self._where[name].tensors[name].dtype

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        return self._where[name].read(name, rows)


class _PickleSource:
    """State dicts from ``pytorch_model*.bin``, loaded with ``weights_only=True``."""

    def __init__(self, files: list[Path]):
        from ..errors import require

        torch = require("torch", "torch==2.13.0", "Reading pickled .bin weights")
        self._tensors: dict[str, np.ndarray] = {}
        for path in files:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[attr-defined]
            except Exception as exc:  # torch raises many types for a bad file
                raise CheckpointError(f"cannot load {path}: {exc}") from exc
            for name, value in state.items():
                self._tensors[name] = value.float().numpy()

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        arr = self._tensors[name]
        return arr if rows is None else arr[rows]


@dataclass
class Checkpoint:
    """A checkpoint directory: its config, its weight files and a tensor reader."""

    path: Path
    config: dict
    weight_files: list[Path]
    source: _TensorSource = field(repr=False)

    @classmethod
    def open(cls, path: Path | str, allow_pickle: bool = False) -> Checkpoint:
        """Open and check a checkpoint directory.

        Raises:
            CheckpointError: with what is missing or wrong and what to do about it.
        """
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} does not exist or is not a directory")
        config_path = path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(
                f"{path} has no config.json; expected a Hugging Face checkpoint directory "
                "(config.json, *.safetensors, tokenizer files), e.g. one written by save_pretrained()"
            )
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{config_path} is not valid JSON: {str(exc)[:200]}") from exc
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_path} does not hold a JSON object")
        files = _safetensors_files(path)
        source: _TensorSource
        if files:
            source = _SafetensorsSource(files)
        else:
            pickles = sorted(path.glob("pytorch_model*.bin")) or sorted(path.glob("*.bin"))
            if not pickles:
                raise CheckpointError(
                    f"{path} has no weights: expected model.safetensors, sharded *.safetensors with "
                    "model.safetensors.index.json, or (with --allow-pickle) pytorch_model*.bin"
                )
            if not allow_pickle:
                raise CheckpointError(
                    f"{path} only has pickled weights ({', '.join(p.name for p in pickles)}). Pickle files "
                    "can run code when loaded, so they are refused by default. Convert them to "
                    "safetensors, or pass --allow-pickle if you trust their source."
                )
            files = pickles
            source = _PickleSource(pickles)
        return cls(path=path, config=config, weight_files=files, source=source)

    def has(self, name: str) -> bool:
        return name in self._names

    @cached_property
    def _names(self) -> set[str]:
        return set(self.source.names())

    def shape(self, name: str) -> tuple[int, ...]:
        self._check(name)
        return self.source.shape(name)

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Read one tensor, or a range of its rows, as float32 (float16 stays float16)."""
        self._check(name)
        arr = self.source.read(name, rows)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        return arr

    def _check(self, name: str) -> None:
        if name not in self._names:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' is missing from the checkpoint's weights; "
                "the checkpoint is incomplete or not of the architecture its config.json names"
            )


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {str(exc)[:200]}") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        names = sorted(set(weight_map.values()))
        for n in names:
            rel = Path(n)
            if rel.is_absolute() or ".." in rel.parts or not (path / rel).resolve().is_relative_to(path.resolve()):
                raise CheckpointError(f"{index} names the shard {n[:100]!r}, which is not a file inside {path}")
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{path}: shards named in model.safetensors.index.json are missing: {', '.join(missing)}"
            )
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))
