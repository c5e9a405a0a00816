"""vLLM's own KV planner on the shadow target's command lines (tests/shadow/vllm_planner.py, run in
the engine environment): shared by the shadow target's planner checks and the hybrid worker's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvprobe.targets.shadow import launch
from kvprobe.targets.shadow.target import launch_request

PLANNER = Path(__file__).with_name("shadow") / "vllm_planner.py"


def serve_case(exp) -> dict:
    """The serve arguments the shadow target would run for `exp`, minus --host/--port."""
    argv, environ = launch.command(launch_request(exp, port=1))
    serve = argv.index("serve")
    model, rest = argv[serve + 1], argv[serve + 2:]
    at = rest.index("--host")
    return {"model": model, "argv": rest[:at] + rest[at + 4:], "env": environ}


def plan_all(env, cases: list[dict]) -> list[dict]:
    """What vLLM's EngineCore planned for each case (or its refusal), in one process."""
    out = subprocess.run([str(env.python), str(PLANNER)], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=600, start_new_session=True, env={**os.environ, **cases[0]["env"]})
    plans = [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("PLAN ")]
    assert len(plans) == len(cases), out.stderr[-4000:]
    return plans
