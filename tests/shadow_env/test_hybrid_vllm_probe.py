"""Admission of a hybrid model end to end: `kvprobe probe` of gpt-oss-20b (window-128 and full layers
in two KV cache groups) against vLLM 0.33.0's own serving stack (`launch: shadow`), whose worker
registers the groups' specs; vLLM's hybrid KV cache manager admits, frees out-of-window blocks and
reports. One short expectation (expectations/hybrid-vllm-gpt-oss.yaml: 400 blocks, three levels,
~1 min with start-up); the engine's processes must be gone after it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine_envs import engine_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
_PID = re.compile(r"\((?:APIServer|EngineCore)(?:_DP\d+)? pid=(\d+)\)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie holds nothing
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_gpt_oss_admission_on_real_vllm_is_the_ledgers(pytestconfig, tmp_path, capsys):
    engine_env("vllm", "0.33.0", pytestconfig)
    out = subprocess.run([sys.executable, "-m", "kvprobe", "probe", str(REPO / "expectations/hybrid-vllm-gpt-oss.yaml"),
                          "--artifacts", str(tmp_path)], capture_output=True, text=True, timeout=400, cwd=REPO,
                         start_new_session=True)
    with capsys.disabled():
        print("\n" + "\n".join(ln for ln in out.stdout.splitlines()
                               if ln.startswith(("  users", "verdict:")) or " PASS " in ln or " FAIL " in ln))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["verdict"]["passed"]
    pred, reported = result["prediction"], result["engine_facts"]["reported"]
    # the capacity line vLLM printed for its two groups is the ledger's: 400 / (73 + 256) x 4096
    assert (reported["kv_tokens"], reported["num_blocks"]) == (pred["capacity"]["kv_tokens"], 400) == (4979, 400)
    assert [g["group"] for g in pred["capacity"]["groups"]] == ["sliding-window layers (window 128)", "full layers"]
    assert pred["admission"]["binding"] == "kv" and pred["admission"]["binding_group"] == "full layers"
    deep = [lv for lv in result["levels"] if lv["waiting_mean"] >= 2]
    assert deep and all(abs(lv["running_mean"] - pred["admission"]["limit"]) < 0.5 for lv in deep)
    pids = {int(m) for m in _PID.findall((tmp_path / "engine.log").read_text(errors="replace"))}
    assert len(pids) >= 2, "the log names the API server and the EngineCore"
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], f"engine processes left behind: {pids}"
