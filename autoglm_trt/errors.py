"""The project's exceptions: one base class, one subclass per kind of failure.

The CLI maps every ``AutoGLMError`` to a clean message and a non-zero exit code; anything
else is a bug and keeps its traceback.
"""


class AutoGLMError(Exception):
    """Base class of every error this toolkit raises on purpose."""


class CheckpointError(AutoGLMError):
    """The checkpoint is missing, incomplete, corrupt or of an unsupported kind."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its options is not supported."""


class ExportError(AutoGLMError):
    """The ONNX export could not be written."""


class ValidationError(AutoGLMError):
    """The exported graph does not match the reference model within tolerance."""


class RequestError(AutoGLMError):
    """A generation request the engine cannot serve as asked (malformed, too large, or failed)."""


class BusyError(RequestError):
    """A well-formed request the engine cannot take now (its bounded queue for some work is full); retry."""


class MissingDependencyError(AutoGLMError):
    """An optional dependency needed by this command is not installed."""


def require(module: str, extra: str, purpose: str) -> object:
    """Import an optional module or raise an error that says how to install it.

    Args:
        module: importable module name, e.g. ``"transformers"``.
        extra: the pip extra or package that provides it, e.g. ``"autoglm-trt[test]"``.
        purpose: what the module is needed for, used in the message.

    Returns:
        The imported module.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{purpose} needs the Python module '{module}', which is not installed "
            f"({exc}). Install it with: pip install '{extra}'"
        ) from exc
