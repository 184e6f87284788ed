"""The one step contract every runtime backend runs (Polygraphy's runner, for a paged decoder).

A runner owns the KV block pools and runs one step of the engine's graph: given the step
inputs (``kvcache.step_inputs``) and the slots of the new tokens, it returns each
sequence's logits (which its next step may overwrite) and has written the new K/V into its
pools. ``copy_blocks`` copies whole blocks of every pool (copy-on-write of a block that forked
sequences share; the scheduler asks for it before the step that writes there). ``close`` frees
what it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..kvcache.host_pools import SlotMap

if TYPE_CHECKING:
    import onnx

    from ..artifacts import ExportRecord, Manifest
    from .onnxrt.offline import GraphRunner


class StepRunner(Protocol):
    num_blocks: int
    block_size: int

    def step(self, feeds: dict[str, np.ndarray], slots: SlotMap) -> np.ndarray:
        """Run one step; return float32 logits ``[batch, vocab]``: possibly the runner's own output
        buffer, valid until its next step (a caller that keeps logits longer copies them)."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """For each (source, destination), copy block source to block destination in every K and V pool."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BackendTraits:
    """What a backend builds and how its graphs differ: the builder, the runtime and the CLI read
    these and never a backend's name."""

    graph_dtype: str  # the float type of a quantized precision's graph (Q/DQ, GEMMs, attention, KV cache)
    int4_block: int  # inputs per INT4 weight scale by default
    int4_blocks: tuple[int, ...] = ()  # the INT4 block sizes it builds (empty: any power of two from 16)
    symmetric_int4: bool = False  # INT4 without zero points
    int8_channels: bool = False  # 8-bit weight-only weights one scale per output channel (no INT8 blocks)
    int8_embedding: bool = True  # the token embedding as INT8 rows
    unit_kv_scales: bool = False  # an INT8 KV cache's scales as a division and a product around Q/DQ of scale 1
    token_kv_scales: bool = True  # builds an INT8 KV cache scaled per token (kv_scales token)
    dynamic_int8: bool = True  # runs INT8 linears that quantize activations at run time (int8-dyn)
    host_memory: bool = True  # its KV pool lives in this process's memory, sized (and resizable) at load
    compiled_vision: bool = False  # the vision encoder is compiled into an engine of its own (else ONNX graphs)
    auto_rank: int = 0  # ``--backend auto`` takes the first available by rank


@dataclass
class Built:
    """A backend's engine file in the build's directory, its build report, and what it adds to the
    manifest (its own section, by its name)."""

    engine_file: str
    report: dict
    manifest: dict[str, Any]


class Backend(Protocol):
    """One backend (``backends/<name>/``), registered by name in ``backends.registry``."""

    name: str  # as --backend and the manifest say it
    label: str  # as messages say it
    traits: BackendTraits

    def available(self) -> tuple[bool, str]:
        """Whether it can build and run engines here, and why (not)."""
        ...

    def require(self) -> None:
        """Raise with the reason when it cannot build here."""
        ...

    def write_engine(self, graph_file: Path, out_dir: Path, settings: EngineSettings,
                     rewritten: onnx.ModelProto | None) -> tuple[str, dict]:
        """Optimize or compile ``graph_file`` (or ``rewritten``, its graph changed, weights beside it)
        into ``out_dir``: (engine file name, build report)."""
        ...

    def finish(self, out_dir: Path, record: ExportRecord, kv_dtype: str, eight_bit_activations: bool,
               dynamic_int8: bool, report: dict, log: Callable[[str], None]) -> dict[str, Any]:
        """After the engine file (and the vision encoder) are written: what the backend adds to the
        engine directory, as manifest fields."""
        ...

    def problems(self, manifest: Manifest) -> list[str]:
        """Why this machine cannot run the engine (empty when it can)."""
        ...

    def file_problems(self, manifest: Manifest) -> list[str]:
        """Whether the engine file is what this backend loads."""
        ...

    def open_runner(self, manifest: Manifest, num_blocks: int, threads: int, spinning: bool) -> StepRunner:
        """The engine's step runner with a pool of ``num_blocks`` KV blocks."""
        ...

    def graph_runner(self, manifest: Manifest, threads: int) -> GraphRunner | None:
        """The engine's graph as a ``GraphRunner`` (logits of whole windows, for ``eval``), where
        this backend runs it in process; else None."""
        ...

    def build_lines(self, report: dict) -> list[str]:
        """``inspect``'s lines on the build report (fusions, layers)."""
        ...

    def inspect(self, manifest: Manifest, report: dict | None) -> tuple[dict | None, list[str]]:
        """``inspect``'s view of what runs the engine here: a record for ``--json`` and its lines."""
        ...

    def findings(self, manifest: Manifest) -> list[str]:
        """``doctor``'s lines on what runs the engine here."""
        ...

    def vision_runs(self, manifest: Manifest) -> str:
        """What runs an image-text engine's vision encoder here."""
        ...


@dataclass(frozen=True)
class EngineSettings:
    """The build config's fields a backend's ``write_engine`` reads."""

    threads: int
    profiles: dict
    workspace_bytes: int
    optimization_level: int
    timing_cache: Path
