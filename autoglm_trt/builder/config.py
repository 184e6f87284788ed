"""Build configuration: YAML file + command-line overrides -> a checked ``BuildConfig``.

Unknown keys and wrong types are errors that name the key, what was expected and what came.
The KV pool is sized by ``kv_num_blocks`` or, if that is not given, by ``kv_memory_bytes``.

The sequence limits and the pool left unset follow the model (``BuildConfig.resolved``, once
the export is known): a text model gets sequences of 2,048 tokens, prefill chunks of 1,024 and a
512 MiB pool; an image-text model, whose prompts carry screenshots of thousands of tokens
(one 1080 x 2400 screenshot is 3,108 at 5,000,000 pixels), sequences as long as its export
allows (its checkpoint's ``max_position_embeddings``, up to 65,536), chunks of 4,096 (a
screenshot's prefill in one or two) and a pool that holds at least one such sequence; where
that pool would take more than half the memory available here, the pool is half of it and the
sequence as long as it holds, said at build.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import AutoGLMError
from ..graph.vision_trt import VISION_DTYPES
from ..model.spec import ModelSpec
from ..record_schema import brief


class BuildConfigError(AutoGLMError):
    """The build configuration is invalid."""


TEXT_MAX_SEQ_LEN, TEXT_MAX_INPUT_LEN = 2048, 1024
IMAGE_MAX_INPUT_LEN = 4096
KV_MEMORY_BYTES = 512 * 1024 * 1024
VISION_LINEARS = ("auto", "int8", "float32")
VISION_ATTENTION = ("auto", "bfloat16", "float32")
KV_SHARE = 0.5  # of the memory available at build, the most a pool sized for the model takes


@dataclass
class BuildConfig:
    max_batch_size: int = 16
    max_input_len: int | None = None  # longest prefill chunk of one sequence (None: from the model)
    max_seq_len: int | None = None  # prompt + generated tokens (None: from the model)
    kv_block_size: int = 16
    kv_num_blocks: int | None = None  # pool size; default from kv_memory_bytes
    kv_memory_bytes: int | None = None  # pool size in bytes (None: from the model)
    prefill_opt_batch: int = 1
    prefill_opt_tokens: int = 128
    decode_opt_batch: int = 8
    workspace_bytes: int = 4 * 1024**3
    timing_cache: str | None = None  # path; default engines/.cache/timing.cache
    builder_optimization_level: int = 3
    threads: int = 0  # ONNX Runtime intra-op threads (0: one per core)
    kv_cache_dtype: str | None = None  # float32 | float16 | int8; default: the engine's float dtype
    kv_scales: str = "head"  # int8 KV: "head" (calibrated, static, one per KV head) or "token" (made with each token)
    # image-text models: the most pixels an image is resized to (default: the checkpoint's preprocessor
    # config; a TensorRT vision engine is built for it), and images per prompt (the runtime's defaults)
    max_pixels: int | None = None
    max_images: int = 10
    # a TensorRT vision engine's linears and attention: bfloat16 (GLM-4.1V's own), float16 or float32
    vision_dtype: str = "bfloat16"
    # an ONNX Runtime engine's vision linears: "int8" (activations per token, weights per channel; run
    # where the CPU sums bytes exactly, graph.vision_int8), "float32", or "auto": int8 for the
    # precisions whose decoder rounds its activations to 8 bits anyway, float32 for the others
    vision_linears: str = "auto"
    # and its attention: "bfloat16" (the native ImageAttentionBf16 where the CPU has AVX512-BF16),
    # "float32" (ONNX Runtime's MultiHeadAttention), or "auto": as vision_linears's auto
    vision_attention: str = "auto"

    def check(self) -> None:
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "kv_block_size", "kv_memory_bytes",
                     "prefill_opt_batch", "prefill_opt_tokens", "decode_opt_batch", "workspace_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise BuildConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_pixels is not None and self.max_pixels < 1:
            raise BuildConfigError(f"max_pixels must be >= 1, got {self.max_pixels}")
        if self.vision_dtype not in VISION_DTYPES:
            raise BuildConfigError(f"vision_dtype must be one of {', '.join(VISION_DTYPES)}, got {brief(self.vision_dtype)}")
        if self.vision_linears not in VISION_LINEARS:
            raise BuildConfigError(f"vision_linears must be one of {', '.join(VISION_LINEARS)}, "
                                   f"got {brief(self.vision_linears)}")
        if self.vision_attention not in VISION_ATTENTION:
            raise BuildConfigError(f"vision_attention must be one of {', '.join(VISION_ATTENTION)}, "
                                   f"got {brief(self.vision_attention)}")
        if self.max_images < 0:
            raise BuildConfigError(f"max_images must be >= 0, got {self.max_images}")
        if self.max_input_len is not None and self.max_seq_len is not None and self.max_input_len > self.max_seq_len:
            raise BuildConfigError(f"max_input_len ({self.max_input_len}) exceeds max_seq_len ({self.max_seq_len})")
        if self.kv_cache_dtype not in (None, "float32", "float16", "int8"):
            raise BuildConfigError(f"kv_cache_dtype must be float32, float16 or int8, got {brief(self.kv_cache_dtype)}")
        if self.kv_scales not in ("head", "token"):
            raise BuildConfigError(f"kv_scales must be head or token, got {brief(self.kv_scales)}")
        if self.kv_scales == "token" and self.kv_cache_dtype != "int8":
            raise BuildConfigError("kv_scales token is for an INT8 KV cache: add kv_cache_dtype int8 "
                                   f"(got {brief(self.kv_cache_dtype)})")
        if not 0 <= self.builder_optimization_level <= 5:
            raise BuildConfigError(f"builder_optimization_level must be 0..5, got {self.builder_optimization_level}")
        if self.kv_num_blocks is not None and self.max_seq_len is not None and self.kv_num_blocks < self.blocks_per_seq:
            raise BuildConfigError(
                f"kv_num_blocks ({self.kv_num_blocks}) cannot hold even one sequence of max_seq_len "
                f"{self.max_seq_len} ({self.blocks_per_seq} blocks of {self.kv_block_size})")

    def resolved(self, spec: ModelSpec, export_max_seq_len: int, kv_bytes_per_elem: int, available: int | None,
                 log: Callable[[str], None]) -> BuildConfig:
        """This config with the limits it leaves unset taken from the model (the module's docstring):
        ``export_max_seq_len`` is what the export allows, ``available`` the memory available here."""
        images = bool(spec.vision)
        max_seq = self.max_seq_len or (export_max_seq_len if images else TEXT_MAX_SEQ_LEN)
        block = self.block_bytes(spec, kv_bytes_per_elem)
        memory = self.kv_memory_bytes
        if memory is None and self.kv_num_blocks is None:
            memory = KV_MEMORY_BYTES
            if images:  # at least one whole sequence, within half of what is available
                one = -(-max_seq // self.kv_block_size) * block
                cap = max(int(KV_SHARE * available), KV_MEMORY_BYTES) if available is not None else one
                memory = max(memory, min(one, cap))
        if images and self.max_seq_len is None:
            blocks = self.kv_num_blocks if self.kv_num_blocks is not None else (memory or KV_MEMORY_BYTES) // block
            if blocks * self.kv_block_size < max_seq:
                log(f"max_seq_len {blocks * self.kv_block_size:,} (the model allows {max_seq:,}): the KV pool "
                    f"({blocks * block / 2**30:.1f} GiB, at most half the memory available here unless kv_memory_bytes "
                    "or kv_num_blocks says otherwise) holds one sequence that long; set max_seq_len to choose")
                max_seq = blocks * self.kv_block_size
            log(f"an image-text model: sequences of up to {max_seq:,} tokens, prefill chunks of "
                f"{self.max_input_len or min(IMAGE_MAX_INPUT_LEN, max_seq):,}, a KV pool of "
                f"{(blocks * block) / 2**30:.2f} GiB")
        max_input = self.max_input_len or min(IMAGE_MAX_INPUT_LEN if images else TEXT_MAX_INPUT_LEN, max_seq)
        out = dataclasses.replace(self, max_seq_len=max_seq, max_input_len=max_input, kv_memory_bytes=memory)
        out.check()
        return out

    @property
    def blocks_per_seq(self) -> int:
        assert self.max_seq_len is not None, "resolve the config first (BuildConfig.resolved)"
        return -(-self.max_seq_len // self.kv_block_size)

    def block_bytes(self, spec: ModelSpec, kv_bytes_per_elem: int) -> int:
        """Bytes of one KV block: K and V of every layer (and, with per-token scales, a float32
        scale per token and KV head)."""
        row = spec.head_dim * kv_bytes_per_elem + (4 if self.kv_scales == "token" else 0)
        return 2 * spec.num_layers * self.kv_block_size * spec.num_kv_heads * row

    def num_blocks(self, spec: ModelSpec, kv_bytes_per_elem: int) -> int:
        """Pool size: ``kv_num_blocks`` or as many blocks as ``kv_memory_bytes`` holds (K and V, all layers)."""
        if self.kv_num_blocks is not None:
            return self.kv_num_blocks
        per_block = self.block_bytes(spec, kv_bytes_per_elem)
        n = (self.kv_memory_bytes or KV_MEMORY_BYTES) // per_block
        if n < self.blocks_per_seq:
            raise BuildConfigError(
                f"kv_memory_bytes {self.kv_memory_bytes} holds {n} blocks of {per_block} bytes, fewer than one "
                f"sequence of max_seq_len {self.max_seq_len} needs ({self.blocks_per_seq}); raise it")
        return int(n)


_FIELDS = {f.name: f for f in dataclasses.fields(BuildConfig)}


def _coerce(key: str, value: Any) -> Any:
    default = getattr(BuildConfig(), key)
    allowed: tuple[type, ...]
    if key in ("kv_num_blocks", "max_pixels", "max_seq_len", "max_input_len", "kv_memory_bytes"):
        allowed = (int, type(None))
    elif key in ("timing_cache", "kv_cache_dtype"):
        allowed = (str, type(None))
    else:
        allowed = (type(default),)
    if isinstance(value, bool) or not isinstance(value, allowed):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise BuildConfigError(f"build config key '{key}' must be {names}, got {type(value).__name__} {brief(value)}")
    return value


def load_config(path: Path | None, overrides: dict[str, Any]) -> BuildConfig:
    """Read YAML (if given), apply non-None overrides, check."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except OSError as exc:
            raise BuildConfigError(f"cannot read build config {path}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise BuildConfigError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except (yaml.YAMLError, RecursionError) as exc:
            raise BuildConfigError(f"{path} is not valid YAML: {str(exc)[:300]}") from exc
        if not isinstance(data, dict):
            raise BuildConfigError(f"{path} must hold a mapping of keys to values, got {type(data).__name__}")
        for key, value in data.items():
            if key not in _FIELDS:
                raise BuildConfigError(f"{path}: unknown key {brief(key)}; known keys: {', '.join(_FIELDS)}")
            values[key] = _coerce(key, value)
    for key, value in overrides.items():
        if value is not None:
            values[key] = _coerce(key, value)
    cfg = BuildConfig(**values)
    cfg.check()
    return cfg


def dump_config(cfg: BuildConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)

