"""The ONNX Runtime engine's rewrite passes, in order, applied when the engine is built.

Input: the optimized engine graph (``model.opt.onnx``, its weights beside it) and what the
machine's native library offers (``Target``). Output: ``Rewritten``, the graph with native
operators (saved in the engine as ``model.native.onnx`` and its packed weights,
``loader.save_native``), what each pass did or why it did not, and what the graph needs of the
library that runs it (``requires``). ``PASSES_VERSION`` keys the saved graph: an engine whose
native graph was made by other passes is run on its plain graph, with a message to rebuild.

The passes, in order (one module each):

    attention          PagedAttention for decode steps; PrefillAttention (Bf16) for prefills (or the
                       prefill's scores by row, MaskedSoftmax)
    rope_qkv           each layer's QKV split + rope as RopeQKV
    hadamard_quantize  each INT8 linear's rotation + quantization as HadamardQuantize
    kv_quantize        a per-token INT8 KV cache's quantization of each new K and V as QuantizeKVRows
    linears            Int8Linear / FloatLinear / Int8WeightLinear / Int4WeightLinear / Int8BlockLinear
                       over packed weights; the Split and SiLU * up forms
    skip_norm          residual add + RMSNorm as SkipSimplifiedLayerNormalization (no native code)
    linear_skip_norm   that norm into the linear before it (*LinearSkipNorm)
    step_branch        one If per step instead of one per layer

The plain graph (no native library, or one that lacks what the native graph requires) is the
optimized graph with ``skip_norm`` alone. Each pass keys on the tensor names of ``graph/names.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ....model.spec import ModelSpec
from .common import all_nodes

PASSES_VERSION = 7
# computed as ONNX Runtime's float nodes are only with fused multiply-add
FMA_OPS = ("FloatLinear", "FloatLinearSplit", "FloatLinearSiluMul", "FloatLinearSkipNorm", "Int8LinearSiluMul",
           "Int8LinearSkipNorm", "Int8WeightLinearSiluMul", "Int8WeightLinearSkipNorm", "Int4WeightLinearSiluMul",
           "Int4WeightLinearSkipNorm", "Int8BlockLinearSiluMul", "Int8BlockLinearSkipNorm", "PrefillAttention",
           "PrefillAttentionBf16")


@dataclass(frozen=True)
class Target:
    """What the passes may assume of the native library that will run the graph."""

    library: Path | None  # None: no native library (the native passes do nothing)
    why: str = ""  # why there is none
    fma: bool = False  # its float kernels use fused multiply-add, as MLAS's do
    softmax_exact: bool = False  # its MaskedSoftmax gives MLAS's Softmax bit for bit (AVX-512F)

    @classmethod
    def here(cls) -> Target:
        """The native library this machine loads (``autoglm_trt.native``), and what it offers."""
        from .... import native

        library, why = native.library()
        if library is None:
            return cls(None, why)
        try:
            return cls(library, "", native.float_kernel(library) != "portable C", native.softmax_exact(library))
        except (OSError, AttributeError) as exc:  # a library that does not load
            return cls(None, f"the native library {library} did not load: {exc}")

    def lacks(self, requires: Iterable[str]) -> list[str]:
        """Of a native graph's requirements, those this library does not meet."""
        have = {"native": self.library is not None, "fma": self.fma, "softmax_exact": self.softmax_exact}
        return [r for r in requires if not have.get(r, False)]


@dataclass
class PassResult:
    name: str
    applied: int  # places rewritten; 0: nothing done
    why_not: str = ""  # when nothing was done: why

    def as_dict(self) -> dict:
        return {"name": self.name, "applied": self.applied, **({"why_not": self.why_not} if self.why_not else {})}


@dataclass
class Context:
    """What a pass reads and what it leaves for the next ones."""

    model: Any  # onnx.ModelProto, rewritten in place
    spec: ModelSpec
    kv_dtype: np.dtype
    weights_dir: Path
    target: Target
    pack: bool = True
    dynamic_int8: bool = False  # blocked INT8 weights with activations quantized per block (int8-dyn)
    bf16_attention: bool = False  # a prefill's attention in bfloat16 where AMX has it (PrefillAttentionBf16)
    packed: dict[str, np.ndarray] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)  # applied count by pass name
    attention_why: str = ""  # why decode steps keep the graph's attention ("" when they do not)


@dataclass
class Rewritten:
    model: Any  # onnx.ModelProto
    packed: dict[str, np.ndarray]  # the weights the session reads in place, by initializer name
    results: list[PassResult]
    target: Target

    @property
    def native_attention(self) -> bool:
        return any(r.name == "attention" and r.applied for r in self.results)

    @property
    def attention_why(self) -> str:
        """Why decode steps keep the graph's attention ("" when they run the operator)."""
        return "" if self.native_attention else next((r.why_not for r in self.results if r.name == "attention"),
                                                     "the attention pass did not run")

    @property
    def attention(self) -> str:
        """What decode steps' attention runs: "native" or "graph (why)"."""
        return "native" if self.native_attention else f"graph ({self.attention_why})"

    @property
    def native(self) -> bool:
        """Whether any native operator is in the graph (else it needs no library)."""
        from .common import DOMAIN

        return any(n.domain == DOMAIN for n in all_nodes(self.model.graph))

    def requires(self) -> list[str]:
        """What the graph needs of the library that runs it (``Target.lacks``)."""
        ops = {n.op_type for n in all_nodes(self.model.graph)}
        return (["native"] if self.native else []) + (["fma"] if ops & set(FMA_OPS) else []) + \
            (["softmax_exact"] if "MaskedSoftmax" in ops else [])


def _native(run: Callable[[Context], tuple[int, str]]) -> Callable[[Context], tuple[int, str]]:
    """A pass that needs the native library."""
    return lambda ctx: (0, ctx.target.why or "no native library") if ctx.target.library is None else run(ctx)


def _attention(ctx: Context) -> tuple[int, str]:
    from . import attention

    if ctx.kv_dtype not in (np.float32, np.int8):
        return 0, f"the KV cache is {ctx.kv_dtype.name} (the native kernel reads float32 or int8)"
    done, why = attention.rewrite(ctx.model, ctx.spec.num_layers, ctx.target.softmax_exact,
                                  ctx.target.fma and ctx.spec.head_dim % 64 == 0, ctx.bf16_attention)
    return (ctx.spec.num_layers, "") if done else (0, why)


def _rope(ctx: Context) -> tuple[int, str]:
    from . import rope_qkv

    s = ctx.spec
    n = rope_qkv.rewrite(ctx.model, s.num_layers, s.num_heads, s.num_kv_heads, ctx.weights_dir)
    return n, "" if n else "no layer's QKV split and rope has the expected nodes"


def _hadamard(ctx: Context) -> tuple[int, str]:
    from .hadamard_quantize import hadamard_quantize

    n = hadamard_quantize(ctx.model)
    return n, "" if n else "no INT8 linear with an online rotation"


def _kv_quantize(ctx: Context) -> tuple[int, str]:
    from . import kv_quantize

    n = kv_quantize.rewrite(ctx.model)
    return n, "" if n else "no INT8 KV cache with per-token scales"


def _linears(ctx: Context) -> tuple[int, str]:
    from . import linears

    if not ctx.done.get("hadamard_quantize") and not ctx.target.fma:
        return 0, "no INT8 linear, and the library has no fused multiply-add for the float ones"
    ctx.packed = linears.rewrite(ctx.model, ctx.weights_dir, ctx.pack, ctx.target.fma, ctx.dynamic_int8)
    n = sum(1 for node in ctx.model.graph.node if node.op_type.startswith(linears.LINEAR_OPS))
    return n, "" if n else "no linear the operators take"


def _skip_norm(ctx: Context) -> tuple[int, str]:
    from .skip_norm import skip_rms_norm

    n = skip_rms_norm(ctx.model)
    return n, "" if n else "no residual Add followed by its RMSNorm"


def _linear_skip_norm(ctx: Context) -> tuple[int, str]:
    from .linear_epilogues import fuse_skip_norm

    if not ctx.target.fma:
        return 0, "the library has no fused multiply-add (ONNX Runtime's float code was checked against that)"
    n = fuse_skip_norm(ctx.model)
    return n, "" if n else "no residual + RMSNorm after a native linear"


def _step_branch(ctx: Context) -> tuple[int, str]:
    from .step_branch import branch_once

    if not ctx.done.get("attention"):
        return 0, "decode steps keep the graph's attention: no per-layer branch to join"
    return (1, "") if branch_once(ctx.model) else (0, "no per-layer branch")


PASSES: tuple[tuple[str, Callable[[Context], tuple[int, str]]], ...] = (
    ("attention", _native(_attention)),
    ("rope_qkv", _native(_rope)),
    ("hadamard_quantize", _native(_hadamard)),
    ("kv_quantize", _native(_kv_quantize)),
    ("linears", _native(_linears)),
    ("skip_norm", _skip_norm),
    ("linear_skip_norm", _native(_linear_skip_norm)),
    ("step_branch", _native(_step_branch)),
)
PLAIN = ("skip_norm",)  # the passes of the plain graph


def rewrite(model_path: Path, spec: ModelSpec, kv_dtype: str | np.dtype, target: Target, pack: bool = True,
            only: Iterable[str] | None = None, skip: Iterable[str] = (), dynamic_int8: bool = False,
            bf16_attention: bool = False) -> Rewritten:
    """The engine graph at ``model_path`` (loaded without its weights) through the passes, in order:
    ``only`` these, and not those in ``skip``. ``pack`` False: the nodes only, no weight read or
    packed (the graph is then not loadable; for counting nodes). ``dynamic_int8``: blocked INT8
    weights become ``Int8BlockLinear`` (activations quantized per block) even without INT4 ones.
    ``bf16_attention``: a prefill's attention is ``PrefillAttentionBf16``."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    ctx = Context(model, spec, np.dtype(kv_dtype), Path(model_path).parent, target, pack, dynamic_int8,
                  bf16_attention)
    wanted, skipped = (set(only) if only is not None else None), set(skip)
    results = []
    for name, run in PASSES:
        if (wanted is not None and name not in wanted) or name in skipped:
            continue
        applied, why = run(ctx)
        ctx.done[name] = applied
        results.append(PassResult(name, applied, "" if applied else why))
    return Rewritten(model, ctx.packed, results, target)


def decode_nodes(model: Any) -> dict[str, int]:
    """Node count by operator of a decode step of a rewritten graph: the decode branch of an ``If``
    on ``native.decode`` (the step's, or a layer's) in place of the ``If``."""
    from collections import Counter

    from .common import DECODE_CONDITION

    counts: Counter = Counter()
    for node in model.graph.node:
        if node.op_type == "If" and list(node.input) == [DECODE_CONDITION]:
            counts.update(n.op_type for a in node.attribute if a.name == "then_branch" for n in a.g.node)
        else:
            counts[node.op_type] += 1
    return dict(counts)
