"""vLLM's info endpoints (0.33.0): /v1/models, /version and the dev-mode /server_info, read back
into a ReportedCapacity; and the dev-mode body the emulator serves."""

from __future__ import annotations

from kvprobe.engines.base import ReportedCapacity
from kvprobe.engines.vllm.http import MODELS_PATH, SERVER_INFO_PATH, VERSION_PATH

# Dev-mode /server_info?config_format=json: VllmConfig sections -> {field: flag}. The section fields
# are the EngineArgs the flags set (engine/arg_utils.py create_engine_config, 0.33.0); checked
# against a real 0.33.0 server (tests/engines/published/vllm-0.33.0-server_info.json).
SERVER_INFO_FLAGS = {
    "scheduler_config": {"max_num_seqs": "max-num-seqs", "max_num_batched_tokens": "max-num-batched-tokens",
                         "enable_chunked_prefill": "enable-chunked-prefill", "watermark": "watermark",
                         "scheduler_reserve_full_isl": "scheduler-reserve-full-isl",
                         "max_num_active_seqs": "max-num-active-seqs",  # from 0.31.0 (config/scheduler.py L70)
                         # the API server's copy: on the CPU platform always false (platforms/cpu.py forces
                         # it off); kvprobe's shadow worker turns it back on inside EngineCore only
                         "async_scheduling": "async-scheduling"},
    "cache_config": {"block_size": "block-size", "num_gpu_blocks_override": "num-gpu-blocks-override",
                     "gpu_memory_utilization": "gpu-memory-utilization", "cache_dtype": "kv-cache-dtype",
                     "kv_cache_memory_bytes": "kv-cache-memory-bytes",
                     "enable_prefix_caching": "enable-prefix-caching"},
    "parallel_config": {"tensor_parallel_size": "tensor-parallel-size",
                        "pipeline_parallel_size": "pipeline-parallel-size",
                        "data_parallel_size": "data-parallel-size", "enable_expert_parallel": "enable-expert-parallel"},
    "model_config": {"max_model_len": "max-model-len", "dtype": "dtype", "quantization": "quantization",
                     "enforce_eager": "enforce-eager"},
}


# VllmConfig.additional_config (config/vllm.py L429, a dict dumped whole): where --gdn-prefill-backend lands
# (engine/arg_utils.py L2865-2866); the dict without the key is the platform's choice
ADDITIONAL_CONFIG_FLAGS = {"gdn_prefill_backend": "gdn-prefill-backend"}
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # envs.py L1468: "1" mounts the dev routers, /server_info among them


def dev_server_info_body(*, max_num_seqs: int, max_num_batched_tokens: int, enable_chunked_prefill: bool,
                         watermark: float, reserve_full_isl: bool, block_size: int, num_gpu_blocks: int,
                         num_gpu_blocks_override: int | None, enable_prefix_caching: bool, max_model_len: int,
                         model: str, served_model_name: str, user_specified_block_size: bool,
                         gpu_memory_utilization: float = 0.92, max_num_active_seqs: int | None = None,
                         gdn_prefill_backend: str | None = None) -> dict:
    """GET /server_info?config_format=json in dev mode (serve/dev/server_info/api_router.py L43-60):
    `vllm_config` dumped by pydantic (mode json, str fallback), with the sections and fields kvprobe
    reads as a real 0.33.0 server writes them (tests/engines/published/vllm-0.33.0-server_info.json;
    the real dump has many more fields, and `vllm_env` / `system_env` beside it)."""
    return {"vllm_config": {
        "model_config": {"model": model, "tokenizer": model, "dtype": "torch.bfloat16", "max_model_len": max_model_len,
                         "served_model_name": served_model_name, "quantization": None, "enforce_eager": False},
        "cache_config": {"block_size": block_size, "user_specified_block_size": user_specified_block_size,
                         "gpu_memory_utilization": gpu_memory_utilization, "cache_dtype": "auto",
                         "num_gpu_blocks_override": num_gpu_blocks_override,
                         "enable_prefix_caching": enable_prefix_caching, "num_gpu_blocks": num_gpu_blocks,
                         "kv_cache_memory_bytes": None},
        "parallel_config": {"pipeline_parallel_size": 1, "tensor_parallel_size": 1, "data_parallel_size": 1,
                            "enable_expert_parallel": False},
        "scheduler_config": {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
                             "enable_chunked_prefill": enable_chunked_prefill, "policy": "fcfs",
                             "scheduler_reserve_full_isl": reserve_full_isl, "watermark": watermark,
                             "max_num_active_seqs": max_num_active_seqs, "async_scheduling": False},
        "additional_config": {"gdn_prefill_backend": gdn_prefill_backend} if gdn_prefill_backend else {},
    }, "vllm_env": {}, "system_env": {}}


def _config_value(flag: str, value: object) -> object:
    if flag == "dtype" and isinstance(value, str):
        return value.removeprefix("torch.")  # ModelConfig.dtype is a torch.dtype, dumped with str()
    return value


def _from_server_info(body: dict, path: str) -> ReportedCapacity:
    config = body.get("vllm_config")
    if not isinstance(config, dict):  # config_format=text: one str(VllmConfig), nothing to read safely
        return ReportedCapacity()
    flags: dict[str, object] = {}
    for section, fields in SERVER_INFO_FLAGS.items():
        values = config.get(section) or {}
        for name, flag in fields.items():
            if name in values:
                flags[flag] = _config_value(flag, values[name])
    extra = config.get("additional_config")
    if isinstance(extra, dict):
        flags.update({flag: extra.get(name) for name, flag in ADDITIONAL_CONFIG_FLAGS.items()})
    sched, model = config.get("scheduler_config") or {}, config.get("model_config") or {}
    out = {"max_running": sched.get("max_num_seqs"), "token_budget": sched.get("max_num_batched_tokens"),
           "max_model_len": model.get("max_model_len"), "served_model_name": model.get("served_model_name"),
           "model_path": model.get("model"), "num_blocks": (config.get("cache_config") or {}).get("num_gpu_blocks")}
    out = {k: v for k, v in out.items() if v is not None}
    if isinstance(out.get("served_model_name"), list):  # --served-model-name takes several names
        out["served_model_name"] = out["served_model_name"][0]
    return ReportedCapacity(**out, flags=flags,
                            sources={**{k: path for k in out}, **{f"flags.{k}": path for k in flags}})


def reported_from_info(path: str, body: dict) -> ReportedCapacity:
    if path == MODELS_PATH:
        # openai/models/serving.py show_available_models L64-77: id = the served name, root = the
        # model path, max_model_len = ModelConfig.max_model_len (the auto-fitted value included).
        data = (body.get("data") or [{}])[0]
        out = {"max_model_len": data.get("max_model_len"), "served_model_name": data.get("id"),
               "model_path": data.get("root")}
        out = {k: v for k, v in out.items() if v is not None}
        flags = {"max-model-len": out["max_model_len"]} if "max_model_len" in out else {}
        return ReportedCapacity(**out, flags=flags, sources={**{k: path for k in out},
                                                             **{f"flags.{k}": path for k in flags}})
    if path == VERSION_PATH:
        v = body.get("version")
        return ReportedCapacity(version=v, sources={"version": VERSION_PATH} if v else {})
    if path.startswith(SERVER_INFO_PATH):
        return _from_server_info(body, SERVER_INFO_PATH)
    return ReportedCapacity()
