"""``autoglm-trt triton``: an engine directory -> a Triton model repository.

    REPOSITORY/NAME/config.pbtxt     Python backend, decoupled, TensorRT-LLM's input/output names,
                                     ``instance_group`` of N (each instance loads its own engine),
                                     no dynamic batcher (the engine batches continuously)
    REPOSITORY/NAME/1/model.py       ``model_template.py``
    REPOSITORY/NAME/1/engine/        a copy of the engine: its manifest and the files it names, no
                                     more (a symbolic link is refused, not followed; the copies'
                                     hashes are checked, and again at load)

The ``python_path`` parameter lists where the model imports from, first to last: a numpy 1.x
for the Python backend's utilities when one is installed beside tritonserver (``.triton/site``),
this package's directory, and this interpreter's site-packages. In NVIDIA's tritonserver
container set it with ``--python-path`` to where the package was pip-installed.
"""

from __future__ import annotations

import re
import shutil
import sysconfig
from pathlib import Path

from ..artifacts import MANIFEST, Manifest
from ..errors import AutoGLMError
from ..fileutil import staged_directory

TEMPLATE = Path(__file__).with_name("model_template.py")
INPUTS = (("text_input", "TYPE_STRING", "1", False), ("max_tokens", "TYPE_INT32", "1", True),
          ("temperature", "TYPE_FP32", "1", True), ("top_k", "TYPE_INT32", "1", True),
          ("top_p", "TYPE_FP32", "1", True), ("random_seed", "TYPE_UINT64", "1", True),
          ("stop_words", "TYPE_STRING", "-1", True), ("stream", "TYPE_BOOL", "1", True),
          ("images", "TYPE_STRING", "-1", True),  # BYTES: encoded image files, for an image-text engine
          ("frequency_penalty", "TYPE_FP32", "1", True), ("presence_penalty", "TYPE_FP32", "1", True),
          ("repetition_penalty", "TYPE_FP32", "1", True), ("min_tokens", "TYPE_INT32", "1", True),
          ("return_log_probs", "TYPE_BOOL", "1", True),
          ("guided_decoding_guide_type", "TYPE_STRING", "1", True), ("guided_decoding_guide", "TYPE_STRING", "1", True))


def default_python_path(triton_site: Path | None) -> list[str]:
    paths = [str(triton_site)] if triton_site is not None and triton_site.is_dir() else []
    paths.append(str(Path(__file__).resolve().parents[2]))
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths()[key]
        if p not in paths:
            paths.append(p)
    return paths


def config_pbtxt(name: str, instances: int, python_path: list[str], threads: int, prefix_caching: bool) -> str:
    inputs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ]{" optional: true" if opt else ""} }}'
                        for n, t, d, opt in INPUTS)
    params = {"python_path": ":".join(python_path), "threads": str(threads),
              "prefix_caching": "true" if prefix_caching else "false"}
    parameters = "\n".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            "model_transaction_policy { decoupled: true }\n"
            f"input [\n{inputs}\n]\n"
            'output [\n  { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] },\n'
            '  { name: "output_log_probs" data_type: TYPE_FP32 dims: [ -1 ] }\n]\n'
            f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n{parameters}\n")


def write_repository(engine_dir: Path, out: Path, name: str | None = None, instances: int = 1, threads: int = 0,
                     python_path: list[str] | None = None, triton_site: Path | None = None,
                     prefix_caching: bool = True, force: bool = False) -> Path:
    """Write the repository (atomically); returns the model's directory."""
    manifest = Manifest.read(engine_dir)
    problems = manifest.verify_files()
    if problems:
        raise AutoGLMError(f"engine {engine_dir} cannot be used: " + "; ".join(problems))
    name = name or re.sub(r"[^A-Za-z0-9_.-]", "_", Path(engine_dir).resolve().name)
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise AutoGLMError(f"model name {name!r} must be letters, digits, '_', '.' or '-'")
    if instances < 1:
        raise AutoGLMError(f"--instances must be >= 1, got {instances}")
    paths = python_path if python_path is not None else default_python_path(triton_site)
    if any(":" in p or '"' in p for p in paths):
        raise AutoGLMError("python_path entries may not contain ':' or '\"'")
    with staged_directory(Path(out), force) as tmp:
        version = tmp / name / "1"
        version.mkdir(parents=True)
        copy_engine(manifest, version / "engine")
        shutil.copy2(TEMPLATE, version / "model.py")
        (tmp / name / "config.pbtxt").write_text(config_pbtxt(name, instances, paths, threads, prefix_caching))
    return Path(out) / name


def copy_engine(manifest: Manifest, dest: Path) -> None:
    """The manifest and each file it names into ``dest``: regular files of the engine directory
    itself, never a symbolic link (whose target may be anything outside it); the copies' hashes
    checked against the manifest."""
    dest.mkdir()
    for name in (MANIFEST, *manifest.files):
        src = manifest.dir / name
        if Path(name).name != name or src.is_symlink() or not src.is_file():
            raise AutoGLMError(f"engine file {name} is a symbolic link, a directory or not directly in "
                               f"{manifest.dir}; copy the engine with its files themselves (cp -rL) or rebuild it")
        shutil.copyfile(src, dest / name, follow_symlinks=False)
    problems = Manifest.read(dest).verify_files()
    if problems:
        raise AutoGLMError(f"engine {manifest.dir} changed while it was copied: " + "; ".join(problems))
