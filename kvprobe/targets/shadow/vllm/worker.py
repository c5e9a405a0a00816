"""A model-less vLLM worker: `vllm serve ... --worker-cls kvprobe.targets.shadow.vllm.worker.ShadowWorker`.

vLLM's own executor (`UniProcExecutor` through `WorkerWrapperBase.init_worker`,
v1/worker/worker_base.py L272-335, 0.33.0) builds this class in the EngineCore process in place of
the GPU worker. Everything around it is vLLM's code of the installed version: the CLI and config
resolution, the OpenAI server, AsyncLLM and the detokenizer, EngineCore, the V1 scheduler, the KV
cache manager and block pool, preemption, the KV planner with its capacity line, the metrics.
This worker answers only what the GPU worker would answer:

* the KV cache spec and the KV bytes (`kvspec.py`), so vLLM's planner sizes the pool;
* for each step, one pseudo token per request whose scheduled tokens reach the end of its
  sequence — the last prefill chunk, every decode, the last chunk of a recomputation — never EOS,
  after a step time from kvprobe's time model (the emulator's), overlapped with scheduling when
  async scheduling is on, as a GPU overlaps them.

Runs inside the engine: imports only the standard library, vllm (and torch), `kvprobe.theory` and the
shadow's own engine-side modules (`settings`, `kvspec`, `compat` — where the interfaces of vLLM 0.18.1-0.32.0 and
0.34.0 differ from 0.33.0's, the one place that asks which release runs). Its settings come from the environment the
launcher sets (`kvprobe.targets.shadow.vllm.target`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib

from vllm.logger import init_logger
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.worker_base import WorkerBase

from kvprobe.targets.shadow.settings import (
    ENV_SETTINGS,
    TIME_MODEL_ENV,
    WorkerSettings,
    memory_line,
    restored_line,
    scheduler_line,
)
from kvprobe.targets.shadow.vllm import compat
from kvprobe.targets.shadow.vllm import kvspec as vllm_kvspec
from kvprobe.theory.sim.steptime import TimeModel

# under "vllm." so that vLLM's own handler and format print it in the engine log
logger = init_logger(f"vllm.{__name__}")


class _Sequences:
    """Each request's known length (prompt + the tokens this worker produced), as the GPU model
    runner's `CachedRequestState.num_tokens` (gpu_model_runner.py `_update_states` L1176-1480)."""

    def __init__(self, vocab_size: int, banned: set[int]):
        self.prompt: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.vocab = vocab_size
        self.banned = banned

    def update(self, so) -> None:
        for rid in so.finished_req_ids:
            self.prompt.pop(rid, None)
            self.outputs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            # a request resumed after preemption comes back as a new one on 0.34.0, carrying the tokens it
            # generated before (compat.output_len): its known length is prompt + those, as the runner's is
            self.prompt[new.req_id] = compat.prompt_len(new)
            self.outputs[new.req_id] = compat.output_len(new)
        cached = so.scheduled_cached_reqs
        for rid, n_out in zip(cached.req_ids, cached.num_output_tokens, strict=True):
            # The scheduler's count wins where it is lower: tokens it discarded or rewound (the GPU
            # runner aligns its cached state the same way, L1392-1446). A preempted request keeps
            # its entry until it finishes, as the runner keeps its CachedRequestState.
            if n_out < self.outputs[rid]:
                self.outputs[rid] = n_out

    def sample(self, so) -> tuple[list[str], list[list[int]], int, int]:
        """(req_ids, sampled ids, prefill tokens, decode sequences) of one step. A request samples
        iff computed + scheduled reaches its known length (the discard mask, L2040-2066)."""
        computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        req_ids, sampled = [], []
        prefill = decode = 0
        for rid, n in so.num_scheduled_tokens.items():
            req_ids.append(rid)
            length = self.prompt[rid] + self.outputs[rid]
            if computed.get(rid, 0) + n >= length:
                sampled.append([self._token(rid, self.outputs[rid])])
                self.outputs[rid] += 1
                if n == 1:
                    decode += 1
                else:
                    prefill += n
            else:
                sampled.append([])  # a partial prefill chunk samples nothing
                prefill += n
        return req_ids, sampled, prefill, decode

    def _token(self, rid: str, position: int) -> int:
        """A pseudo token below the vocabulary, never a special (EOS/BOS) id."""
        token = zlib.crc32(f"{rid}:{position}".encode()) % self.vocab
        while token in self.banned:
            token = (token + 1) % self.vocab
        return token


class _StepOutput(AsyncModelRunnerOutput):
    """The step's output, ready when the modelled device time is over (`get_output` blocks until
    then), so vLLM's batch queue schedules the next step meanwhile, as it does on a GPU."""

    def __init__(self, output: ModelRunnerOutput, ready_at: float):
        self._output = output
        self._ready_at = ready_at

    def get_output(self) -> ModelRunnerOutput:
        _wait_until(self._ready_at)
        return self._output

    def get_kv_connector_output(self):
        return None


def _wait_until(t: float) -> None:
    # The modelled device is busy until t: this is the stand-in for a forward pass, not a hope.
    while (left := t - time.monotonic()) > 0:
        time.sleep(left)


class ShadowWorker(WorkerBase):
    """The GPU worker's contract (v1/worker/gpu_worker.py, 0.33.0; where 0.18.1's and 0.19.1's differ, `compat.py`),
    with no device and no model."""

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False, **_ignored) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.settings = WorkerSettings.decode(os.environ.get(ENV_SETTINGS, ""))
        self.time_model = TimeModel.decode(os.environ.get(TIME_MODEL_ENV, ""))
        _undo_cpu_platform(vllm_config, self.settings)
        self.block_size = vllm_kvspec.gpu_block_size(vllm_config, self.settings.block_size)
        vocab = self.model_config.get_vocab_size()
        self.seqs = _Sequences(vocab, _special_ids(self.model_config.hf_config, vocab))
        self._device_free_at = 0.0
        self._pending = None
        self.memory_plan = None

    # --- life cycle ------------------------------------------------------------------------
    def init_device(self) -> None:
        self.device = None

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        vllm_kvspec.layout(self.vllm_config)  # an unsupported layer kind fails here, at start-up

    def get_model(self):
        return None

    def get_supported_tasks(self):
        return ("generate",)

    def get_kv_cache_spec(self):
        return vllm_kvspec.kv_cache_spec(self.vllm_config, self.block_size, self.settings.gpu_capability)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        # No attention backend declares a layout: vLLM's default preference (utils.py L243-262)
        return compat.default_kv_cache_layouts()

    def determine_available_memory(self) -> int:
        plan = vllm_kvspec.available_kv_bytes(self.vllm_config, gpu_memory_bytes=self.settings.gpu_memory_bytes,
                                              estimates=self.settings.estimates)
        override = self.cache_config.num_gpu_blocks_override
        if plan.source == "num_gpu_blocks_override" and (
                pool := compat.override_pool_bytes(override, self.get_kv_cache_spec())):
            plan = dataclasses.replace(plan, kv_bytes=pool, detail="override x bytes per block (vLLM checks the bytes "
                                                                   "before it applies the override: compat.py)")
        self.memory_plan = plan
        logger.info(memory_line(plan.source, plan.kv_bytes, plan.detail))
        return plan.kv_bytes

    def initialize_from_config(self, kv_cache_config) -> None:
        sc = self.vllm_config.scheduler_config
        # the attention block the planner settled on (a hybrid Mamba model's is enlarged to hold a state)
        block = vllm_kvspec.attention_block_size(kv_cache_config, self.block_size)
        logger.info(scheduler_line("AsyncScheduler" if sc.async_scheduling else "Scheduler", sc.async_scheduling,
                                   kv_cache_config.num_blocks, block, self.time_model.encode()))

    def compile_or_warm_up_model(self):
        return compat.compile_times()

    def check_health(self) -> None:
        return

    def shutdown(self) -> None:
        return

    # --- steps -----------------------------------------------------------------------------
    def execute_model(self, scheduler_output):
        """Book the step on the modelled device; the output comes from `sample_tokens`, as on a GPU."""
        so = scheduler_output
        if not so.total_num_scheduled_tokens:
            self.seqs.update(so)  # finished requests still have to be forgotten
            self._pending = None
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.seqs.update(so)
        req_ids, sampled, prefill, decode = self.seqs.sample(so)
        start = max(time.monotonic(), self._device_free_at)  # one stream: steps do not overlap
        self._device_free_at = start + self.time_model.step_seconds(prefill, decode)
        output = compat.runner_output(req_ids, sampled)  # the release's fields (compat.py)
        self._pending = (output, self._device_free_at)
        return None

    def sample_tokens(self, grammar_output):
        if self._pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        output, ready_at = self._pending
        self._pending = None
        if self.vllm_config.scheduler_config.async_scheduling:
            return _StepOutput(output, ready_at)
        _wait_until(ready_at)
        return output

    def take_draft_token_ids(self):
        return None

    # --- what the executor may call, with nothing behind it ----------------------------------
    def get_kv_connector_handshake_metadata(self):
        return None

    def get_cache_block_size_bytes(self) -> int:
        return 0

    def get_simple_cpu_offload_num_cpu_blocks(self):
        return None

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def reset_mm_cache(self) -> None:
        return

    def reset_encoder_cache(self) -> None:
        return

    def add_lora(self, lora_request) -> bool:
        return False

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()


def _undo_cpu_platform(vllm_config, settings: WorkerSettings) -> None:
    """Put back what vLLM's CPU platform overwrote and a CUDA GPU keeps (platforms/cpu.py
    `check_and_update_config`, 0.33.0): async scheduling (forced off, L346-348) and, for MLA, chunked
    prefill, prefix caching and the step budget (forced off / off / max(max_model_len, 8192),
    L531-548). This runs in the worker's __init__, before EngineCore builds its scheduler, KV cache
    manager and batch queue (v1/engine/core.py L150-215), on the config object the `uni` executor
    shares with it."""
    sc, cc, mc = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    prefix = settings.prefix_caching
    if prefix is None:  # the user left it to vLLM: on where the model supports it (config/model.py L2239-2291)
        prefix = bool(mc.is_prefix_caching_supported)
    wanted = [(sc, "async_scheduling", settings.async_scheduling),
              (sc, "enable_chunked_prefill", settings.chunked_prefill),
              (cc, "enable_prefix_caching", prefix)]
    if settings.max_num_batched_tokens:
        wanted.append((sc, "max_num_batched_tokens", settings.max_num_batched_tokens))
    if mc.is_hybrid:  # a Mamba/linear-attention state: the GPU's SSM dtype (cpu.py L318-337 resets it)
        wanted.append((cc, "mamba_ssm_cache_dtype", settings.mamba_ssm_cache_dtype))
    changes = []
    for obj, name, value in wanted:
        if getattr(obj, name) != value:
            changes.append(f"{name} {getattr(obj, name)} -> {value}")
            setattr(obj, name, value)
    if changes:
        logger.info(restored_line(changes))


def _special_ids(hf_config, vocab: int) -> set[int]:
    """EOS/BOS/PAD ids of the config (a pseudo token is never one of them)."""
    ids: set[int] = set()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(hf_config, key, None)
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, int) and 0 <= v < vocab:
                ids.add(v)
    return ids
