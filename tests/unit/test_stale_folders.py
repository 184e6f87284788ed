"""Folders a killed run leaves beside its output (fileutil.remove_stale_siblings)."""

import os
import subprocess
import sys

from autoglm_trt.fileutil import remove_stale_siblings, scratch_prefix, staged_directory


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_folders_are_removed_and_a_running_ones_kept(tmp_path):
    out = tmp_path / "engine"
    dead, alive = _dead_pid(), os.getpid()
    stale = [tmp_path / f".engine.partial-{dead}", tmp_path / f".engine.old-{dead}",
             tmp_path / f".engine-scratch-{dead}-x1y2"]
    kept = [tmp_path / f".engine.partial-{alive}", tmp_path / f"{scratch_prefix(out)}abc",
            tmp_path / f".engine2.partial-{dead}", tmp_path / f".engine.partial-{dead}x", tmp_path / "engine"]
    for path in stale + kept:
        path.mkdir()
        (path / "weights.bin").write_bytes(b"0" * 10)
    (tmp_path / f".engine.old-{dead}.txt").write_text("a file, not a run's folder")
    assert sorted(remove_stale_siblings(out)) == sorted(stale)
    assert not any(p.exists() for p in stale)
    assert all(p.is_dir() for p in kept) and (tmp_path / f".engine.old-{dead}.txt").is_file()


def test_a_staged_output_clears_what_a_killed_run_left(tmp_path):
    out = tmp_path / "engine"
    left = tmp_path / f".engine.partial-{_dead_pid()}"
    left.mkdir()
    with staged_directory(out, force=False) as tmp:
        (tmp / "x").write_text("1")
    assert (out / "x").read_text() == "1" and not left.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
