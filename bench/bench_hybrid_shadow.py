"""Hybrid models' admission on the real vLLM 0.33.0 serving stack (`launch: shadow`): `kvprobe probe`
of each shipped hybrid expectation — gpt-oss-20b (window-128 + full layers; also run by the test
suite, tests/shadow_env/test_hybrid_vllm_probe.py) and Qwen3-Next (Gated DeltaNet state slots +
full layers, kept here for the suite's time) — with the per-level figures, the verdict and the wall
time. Installs the engine environment when it is missing; each probe stops its own server.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvprobe.targets.shadow import envs

REPO = Path(__file__).resolve().parents[1]
EXPECTATIONS = ("hybrid-vllm-gpt-oss.yaml", "hybrid-vllm-qwen3-next.yaml")


def main() -> None:
    envs.ensure("vllm", "0.33.0", log=lambda line: print(f"   {line}", flush=True))
    for name in EXPECTATIONS:
        with tempfile.TemporaryDirectory(prefix="kvprobe-bench-hybrid-") as tmp:
            t0 = time.monotonic()
            out = subprocess.run([sys.executable, "-m", "kvprobe", "probe", str(REPO / "expectations" / name),
                                  "--artifacts", tmp], capture_output=True, text=True, timeout=600, cwd=REPO,
                                 start_new_session=True)
            print(f"   {name}: exit {out.returncode} in {time.monotonic() - t0:.0f} s")
            for line in out.stdout.splitlines():
                if line.startswith(("  users", "verdict:")) or " PASS " in line or " FAIL " in line:
                    print(f"   {line}")
            if out.returncode != 0:
                raise RuntimeError(f"{name}: kvprobe probe exited {out.returncode}: {out.stderr[-500:]}")


if __name__ == "__main__":
    main()
