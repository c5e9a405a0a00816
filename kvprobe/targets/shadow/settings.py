"""What crosses from kvprobe into a shadow engine's processes and back: the environment variables
kvprobe's launch sets, the settings they carry, and the lines kvprobe's code inside the engine writes
to the engine's log. Standard library only, and nothing else from kvprobe: both sides import it (the
launch in kvprobe's environment; the vLLM worker inside EngineCore, the SGLang plugin in every SGLang
process, where kvprobe's own dependencies are not installed).

The vLLM worker needs to know what the CPU platform has already overwritten by the time it runs
(vLLM 0.33.0 platforms/cpu.py `check_and_update_config`): whether async scheduling was asked for
(forced off, L346-348), the user's --block-size (forced to 16 for MLA, L290-298), and for MLA
models chunked prefill, prefix caching and the step budget (forced off / off / max(max_model_len,
8192), L531-548). It also needs what a GPU would have measured: the declared GPU memory and the
ledger's estimates.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

# --- both engines: set by kvprobe.targets.shadow.launch for every shadow start
ACTIVE_ENV = "KVPROBE_SHADOW"  # "1": the worker/plugin may act (never set on a GPU install)
TIME_MODEL_ENV = "KVPROBE_SHADOW_TIME_MODEL"  # kvprobe.theory.sim.steptime.TimeModel.encode()

# --- the SGLang plugin (kvprobe.targets.shadow.sglang.plugin and .hooks), set by sglang/target.py
GPU_FREE_ENV = "KVPROBE_SHADOW_GPU_FREE_BYTES"  # a declared GPU's free memory before the weights, bytes
WEIGHT_BYTES_ENV = "KVPROBE_SHADOW_WEIGHT_BYTES"  # the model's weights on the rank (the ledger's), bytes
PLUGIN_LOG_PREFIX = "kvprobe shadow:"  # every line the plugin writes to SGLang's log starts with it

# --- the vLLM worker (kvprobe.targets.shadow.vllm.worker), set by vllm/target.py
ENV_SETTINGS = "KVPROBE_SHADOW_VLLM"  # WorkerSettings.encode()
WORKER_CLS = "kvprobe.targets.shadow.vllm.worker.ShadowWorker"
# The worker's own start-up lines in the engine log (after vLLM's prefix).
WORKER_LINE_PREFIX = "kvprobe shadow worker: "
_RE_SCHED = re.compile(WORKER_LINE_PREFIX + r"scheduler (\w+) \(async_scheduling=(True|False)\), num_blocks=(\d+), "
                       r"block_size=(\d+)")
_RE_MEMORY = re.compile(WORKER_LINE_PREFIX + r"KV memory from ([\w ]+): (-?\d+) bytes")
_RE_RESTORED = re.compile(WORKER_LINE_PREFIX + r"restored what the CPU platform changed and a CUDA GPU keeps: (.*)$",
                          re.M)


@dataclass(frozen=True)
class WorkerSettings:
    async_scheduling: bool = True  # the CUDA default; False only for --no-async-scheduling
    block_size: int | None = None  # --block-size as the user gave it (None: the GPU backend's choice)
    chunked_prefill: bool = True  # False only for --no-enable-chunked-prefill
    prefix_caching: bool | None = None  # --[no-]enable-prefix-caching; None: vLLM's default for the model
    max_num_batched_tokens: int | None = None  # the step budget the launcher passed (the GPU's default or the flag)
    # --mamba-ssm-cache-dtype as given ("auto" when absent): the CPU platform resets it to float32
    # for its accelerated GDN kernels (platforms/cpu.py L318-337); a CUDA GPU keeps it
    mamba_ssm_cache_dtype: str = "auto"
    gpu_memory_bytes: int | None = None  # a declared GPU (hardware.gpu_memory / --gpu-memory)
    # a named card's compute capability (hardware.gpu): a GDN layer's prefill kernel, so its checkpoint block
    gpu_capability: str | None = None
    estimates: dict[str, int] = field(default_factory=dict)  # the ledger's non-KV overrides, bytes

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> WorkerSettings:
        values = json.loads(text) if text else {}
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{ENV_SETTINGS}: unknown setting(s) {unknown}; expected {sorted(known)}")
        return cls(**values)


def scheduler_line(scheduler: str, async_scheduling: bool, num_blocks: int, block_size: int, time_model: str) -> str:
    return (f"{WORKER_LINE_PREFIX}scheduler {scheduler} (async_scheduling={async_scheduling}), "
            f"num_blocks={num_blocks}, block_size={block_size}, time model {time_model}")


def restored_line(changes: list[str]) -> str:
    return f"{WORKER_LINE_PREFIX}restored what the CPU platform changed and a CUDA GPU keeps: {'; '.join(changes)}"


def memory_line(source: str, kv_bytes: int, detail: str) -> str:
    return f"{WORKER_LINE_PREFIX}KV memory from {source}: {kv_bytes} bytes ({detail})"


def parse_worker_lines(text: str) -> dict:
    """What the worker said at start-up (the last start in the log wins); {} when it said nothing."""
    out: dict = {}
    for m in _RE_MEMORY.finditer(text):
        out.update(kv_memory_source=m.group(1), kv_memory_bytes=int(m.group(2)))
    for m in _RE_RESTORED.finditer(text):
        out["restored"] = m.group(1).strip().split("; ")
    for m in _RE_SCHED.finditer(text):
        out.update(scheduler=m.group(1), async_scheduling=m.group(2) == "True", num_blocks=int(m.group(3)),
                   block_size=int(m.group(4)))
    return out
