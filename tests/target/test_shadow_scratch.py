"""A shadow target's processes keep their temporary files in a folder of its own (TMPDIR), removed once
its group is gone (kvprobe.targets.shadow.target.ShadowTarget): what SGLang and vLLM leave in the
temporary folder on every start does not pile up in /tmp. The real engines' leftovers are checked where
their servers stop (tests/shadow_sglang/conftest.py stop_server, tests/shadow/test_repro_vllm.py)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from kvprobe.errors import TargetError
from kvprobe.targets.shadow.target import ShadowTarget

from .conftest import fake_argv


@pytest.fixture
def temp_root(tmp_path, monkeypatch) -> Path:
    """The temporary folder this test's targets make theirs under (other workers' stay out of it)."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def left_file(log: Path) -> Path:
    return Path(re.search(r"temp file (\S+)", log.read_text()).group(1))


def test_the_engines_temporary_files_go_with_its_stop(temp_root, tmp_path):
    log = tmp_path / "engine.log"
    target = ShadowTarget.launch(fake_argv("--leave-temp-file"), engine="vllm", log_path=str(log),
                                 startup_timeout=20)
    try:
        scratch = Path(target.scratch)
        assert scratch.parent == temp_root and scratch.name.startswith("kvprobe-shadow-")
        assert left_file(log).parent == scratch and left_file(log).exists()  # the engine's TMPDIR
    finally:
        target.stop(grace=5)
    assert not scratch.exists() and list(temp_root.iterdir()) == []
    target.stop()  # idempotent, the folder already gone


def test_a_failed_start_leaves_no_folder(temp_root, tmp_path):
    with pytest.raises(TargetError, match="exited with code 3 during start-up"):
        ShadowTarget.launch(fake_argv("--leave-temp-file", "--mode", "exit"), engine="vllm",
                            log_path=str(tmp_path / "engine.log"), startup_timeout=20)
    assert list(temp_root.iterdir()) == []


def test_a_tmpdir_the_expectation_names_is_the_engines_and_kept(temp_root, tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    log = tmp_path / "engine.log"
    with ShadowTarget.launch(fake_argv("--leave-temp-file"), engine="vllm", log_path=str(log), startup_timeout=20,
                             env={"TMPDIR": str(own)}) as target:
        assert target.scratch is None
    assert left_file(log).parent == own and left_file(log).exists()
    assert list(temp_root.iterdir()) == []
