"""Helpers of the hybrid-model checks that run the engines' own code in their environments."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvprobe.targets.shadow import envs

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TIMEOUT = 600.0  # seconds for one engine subprocess: imports alone take ~5-10 s on 2 busy cores


def run_json(env: envs.EngineEnv, args: list[str], payload, extra_env: dict | None = None) -> object:
    """Run `env`'s python with kvprobe importable, `payload` as JSON on stdin; the last stdout line
    is the JSON answer. A failure carries the engine's stderr tail."""
    out = subprocess.run([str(env.python), *args], input=json.dumps(payload), capture_output=True,
                         text=True, timeout=TIMEOUT, start_new_session=True, cwd=str(REPO),
                         env={**os.environ, **_import_env(env.engine), "PYTHONPATH": str(REPO),
                              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(extra_env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _import_env(engine: str) -> dict[str, str]:
    try:
        return envs.shadow_import_env(engine)
    except AttributeError:  # a dialect without shadow facts on this branch
        return {}


def model_folder(tmp: Path, name: str, config: dict) -> str:
    folder = tmp / name.replace("/", "--")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)
