"""vLLM 0.33's CPU platform choice, as a platform plugin for a release that lacks it.

Copied by `kvprobe.targets.shadow.vllm.env` into a vLLM 0.18.1 engine environment as the module
`kvprobe_vllm_cpu_platform`, with an entry point in vLLM's group `vllm.platform_plugins`. This file
imports nothing of kvprobe's: the environment's own `vllm` loads it in every process (the API
server, EngineCore) before kvprobe is on any path.

Why: 0.33.0's `cpu_platform_plugin` takes the CPU platform when `VLLM_TARGET_DEVICE=cpu`
(vllm/platforms/__init__.py L173-181, 0.33.0); 0.18.1's takes it only for a vLLM built for CPU (a
version containing "cpu") or on macOS (vllm/platforms/__init__.py L163-185, 0.18.1), so the PyPI
wheel on this Linux machine finds no platform and `vllm serve` stops with "Failed to infer device
type" (config/device.py L56). An out-of-tree platform plugin wins over the built-in ones when it is
the only one that answers (vllm/platforms/__init__.py L213-250, 0.18.1). This one answers only under
the same condition 0.33 reads, so a process without `VLLM_TARGET_DEVICE=cpu` sees no change.
"""

import os


def cpu_platform():
    if os.environ.get("VLLM_TARGET_DEVICE", "cuda").lower() == "cpu":
        return "vllm.platforms.cpu.CpuPlatform"
    return None
