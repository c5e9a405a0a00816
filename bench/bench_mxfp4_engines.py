"""gpt-oss's MXFP4 expert bytes (kvprobe/theory/model/mxfp4.py) against the buffers vLLM 0.33.0's and
SGLang 0.5.23's own create_weights allocate, on the meta device in each engine's environment
(bench/mxfp4_*_driver.py): per GPU family (Hopper, Blackwell), expert count (20b: 32, 120b: 128) and
TP degree (4 makes I per rank 720, not a multiple of 64), w13 and w2 with their scales and biases.
Here and not in the test suite for its time: the engines' imports take ~20 s. Raises on any
difference; installs an engine environment when it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from kvprobe.targets.shadow import envs
from kvprobe.theory.model.mxfp4 import engine_expert_bytes, engine_expert_dims

HERE = Path(__file__).parent
CASES = [{"arch": a, "experts": e, "hidden": 2880, "inter": 2880, "tp": tp}
         for a in ("sm90", "sm100") for e in (32, 128) for tp in (1, 4)]
VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}


def engine_buffers(engine: str) -> list[dict[str, int]]:
    """{param: nbytes} per case, as the engine's own create_weights makes them."""
    env = envs.ensure(engine, VERSIONS[engine], log=lambda line: print(f"   {line}", flush=True))
    out = subprocess.run([str(env.python), str(HERE / f"mxfp4_{engine}_driver.py"), json.dumps(CASES)],
                         capture_output=True, text=True, timeout=600, start_new_session=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{engine} driver exited {out.returncode}: {out.stderr[-1500:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return [g["bytes"] if engine == "vllm" else g for g in got]


def compare(engine: str, buffers: list[dict[str, int]]) -> list[str]:
    wrong = []
    for case, nbytes in zip(CASES, buffers, strict=True):
        theirs = tuple(sum(v for k, v in nbytes.items() if k.startswith(f"{t}_")) for t in ("w13", "w2"))
        ours = tuple(engine_expert_bytes(t, case["experts"], case["hidden"], case["inter"], engine=engine,
                                         gpu_arch=case["arch"], tp=case["tp"]) for t in ("w13", "w2"))
        dims = engine_expert_dims(engine, case["arch"], case["hidden"], case["inter"], case["tp"])
        ok = theirs == ours and len(nbytes) == 6
        print(f"   {engine} {case['arch']} E={case['experts']} TP{case['tp']}: H,I={dims} w13+w2 = "
              f"{theirs[0]:,} + {theirs[1]:,} B (kvprobe {'same' if ok else f'{ours[0]:,} + {ours[1]:,}'})")
        if not ok:
            wrong.append(f"{engine} {case}")
    return wrong


def main() -> None:
    wrong = []
    for engine in VERSIONS:
        t0 = time.monotonic()
        buffers = engine_buffers(engine)
        print(f"   {engine}: driver in {time.monotonic() - t0:.0f} s")
        wrong += compare(engine, buffers)
    if wrong:
        raise RuntimeError(f"kvprobe's MXFP4 expert bytes differ from the engine's: {wrong}")


if __name__ == "__main__":
    main()
