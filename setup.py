"""Builds the native library at install time, one shared library per instruction set
(``autoglm_trt/native/variants.py``); everything else is in ``pyproject.toml``.

The libraries are plain C shared objects for ONNX Runtime and ctypes, not Python extension
modules; each is optional, so an install without a C compiler (or one that cannot target an
instruction set) still succeeds, and the engine runs the graph's own nodes where no build fits.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

NATIVE = Path("autoglm_trt", "native")  # setuptools takes sources relative to this file's directory


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_autoglm_native_{name}", NATIVE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


variants, build = _load("variants"), _load("build")
PREFIX = "autoglm_trt.native."


class BuildNative(build_ext):
    """Each extension named ``autoglm_trt.native.libautoglm-<variant>`` is the variant's library."""

    def get_ext_filename(self, fullname: str) -> str:
        name = fullname.split(".")[-1]  # distutils asks with the full name and with its last part
        if name.startswith("libautoglm-"):
            return str(Path(*fullname.split(".")[:-1], name + ".so"))
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        variant = {v.name: v for v in variants.for_machine()}[ext.name[len(PREFIX + "libautoglm-"):]]
        out = Path(self.get_ext_fullpath(ext.name))
        self.announce(f"building the native library for {variant.name}: {out}", level=2)
        try:
            build.compile_library(out, variant.flags, variants.SOURCES, variants.COMMON_FLAGS)
        except RuntimeError as exc:  # the extension is optional: setuptools warns and goes on
            raise CompileError(str(exc)) from exc


native = [Extension(PREFIX + "libautoglm-" + v.name, sources=[str(NATIVE / "csrc" / s) for s in variants.SOURCES],
                    depends=[str(NATIVE / "csrc" / h) for h in variants.HEADERS], optional=True)
          for v in variants.for_machine()]
setup(ext_modules=native, cmdclass={"build_ext": BuildNative})
