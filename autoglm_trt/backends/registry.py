"""The backends by name: the built-in ones (ONNX Runtime, TensorRT) and any registered beside them.

``backend(name)`` is the one place a name becomes a ``Backend``; everything else reads its traits.
``register`` adds one (its manifest section's check too, so its engines read back), ``choose``
resolves ``--backend auto`` to the first available by ``traits.auto_rank``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..artifacts import BACKEND_SECTIONS
from ..errors import AutoGLMError
from ..precisions import Precision
from .base import Backend
from .onnxrt.backend import BACKEND as ONNXRUNTIME
from .trt.backend import BACKEND as TENSORRT

AUTO = "auto"
_REGISTRY: dict[str, Backend] = {b.name: b for b in (TENSORRT, ONNXRUNTIME)}


def register(b: Backend, section_check: Callable[[dict, Path, Path], None] = lambda section, engine_dir, path: None
             ) -> None:
    """Add ``b`` by its name; ``section_check`` checks its manifest section as engines are read."""
    _REGISTRY[b.name] = b
    BACKEND_SECTIONS.setdefault(b.name, section_check)


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    BACKEND_SECTIONS.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def having(test: Callable[[Backend], bool]) -> list[Backend]:
    """The registered backends ``test`` holds for (a trait, a precision they build), in registration
    order: what an error offers as the other choice."""
    return [b for b in _REGISTRY.values() if test(b)]


def backend(name: str) -> Backend:
    """The backend called ``name``, or an error that names the choices."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise AutoGLMError(f"backend '{name}' is not one of {', '.join((AUTO, *_REGISTRY))}") from None


def builds(b: Backend, p: Precision) -> bool:
    """Whether ``b`` builds engines of precision ``p``."""
    return b.traits.dynamic_int8 or not p.dynamic_int8


def choose(requested: str, log: Callable[[str], None], p: Precision | None = None) -> Backend:
    """The backend ``requested`` (refused where it does not build ``p``, before asking whether it runs
    here; then checked usable here), or for ``auto`` the first of rank order that is usable here and
    builds ``p``, saying which and why the ones before it were passed over."""
    if requested != AUTO:
        chosen = backend(requested)
        if p is not None and not builds(chosen, p):
            able = having(lambda b: builds(b, p))
            raise AutoGLMError(f"{p.name} ({p.help}) runs on {' or '.join(b.label for b in able)}'s engine only; "
                               f"for {chosen.label} build another precision (int8-wo: the same INT8 weights, float "
                               f"activations), or pass --backend {' or '.join(b.name for b in able)}")
        chosen.require()
        return chosen
    passed = []
    for b in sorted(_REGISTRY.values(), key=lambda b: b.traits.auto_rank):
        if p is not None and not builds(b, p):
            passed.append(f"{p.name} does not run on {b.name}")
            continue
        ok, reason = b.available()
        if ok:
            log(f"backend auto: {b.name} ({'; '.join(passed) or reason})")
            return b
        passed.append(reason)
    raise AutoGLMError("no backend can build here: " + "; ".join(passed))
