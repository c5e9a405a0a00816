"""The SGLang shadow's command: real `sglang.launch_server` 0.5.23 from kvprobe's engine environment,
with kvprobe's plugin taking the model out (`kvprobe/targets/shadow/sglang/plugin.py`).

`command(req, env)` (called by `kvprobe.targets.shadow.launch.command`) returns the argv and environment:

- the model: a folder with the preset's config.json and a word-level tokenizer, exposed as the
  snapshot of the preset's hub id in a private HF_HOME, so `--model-path meta-llama/Llama-3.1-8B`
  resolves offline and the served name is the expectation's model; a config.json path is served
  from its folder under `--served-model-name`.
- the flags whose CPU default differs from a GPU's (SGLang 0.5.23 server_args.py, CPU platform):
  `--chunked-prefill-size` (4096 on a CPU; a GPU picks by its memory) and, with a declared GPU,
  `--mem-fraction-static` (0.716 on a CPU; a GPU's by SGLang's formula) get the values kvprobe's
  ledger uses for the launched release (its rules in theory/sglang/memory_profile.py: SGLang's own
  `handle_gpu_memory_settings` sees this CPU's memory, not the declared card, so it cannot resolve
  them itself), unless the expectation sets them; and always the dialect's SHADOW_FLAGS
  (`--device cpu`, `--enable-metrics`, `--sleep-on-idle`; engines/sglang/flags.py says why).
  Why SGLang does not resolve them itself from the declared card (checked for 0.5.19-0.5.23): the
  plugin does reach the launcher before ServerArgs is resolved (launch_server.py: `load_plugins()`
  L71 then `prepare_server_args` L73 in 0.5.19, L79/L81 in 0.5.20-0.5.23), and a REPLACE of
  `sglang.srt.utils.common.get_device_memory_capacity` reaches the from-imports that call it
  (arg_groups/pipeline.py L223 in 0.5.19, memory_hook.py L78 after; HookRegistry `_propagate_patch`).
  But with `--device cpu`, `handle_gpu_memory_settings` sets the decode graph max_bs to
  `torch_compile_max_bs` (32) instead of the card's tier (memory_hook.py L153-183 in 0.5.19, L192-222
  in 0.5.20-0.5.21, L201-231 in 0.5.22-0.5.23), and that enters the reserve: ServerArgs resolved in
  each environment with the card answered gives 0.833 (0.5.19, 24 GiB; the card's 0.833 by rounding),
  0.705 (0.5.20; 0.704), 0.911 (0.5.21, 148 GiB, 70B, --max-running-requests 32; 0.908), 0.914 (0.5.22;
  0.911): a CPU's fractions, in which 0.5.22's lowering of the graph bs to the running cap cannot show.
- the pool: with `--max-total-tokens` SGLang's own configurator sizes it; with a declared GPU the
  plugin hands SGLang that GPU's KV budget (the ledger's weights, SGLang's resolved fraction).
- the memory check: SGLang allocates its KV pool and request table as real buffers, so they must
  fit in this machine's available memory — checked here, before anything starts.
"""

from __future__ import annotations

import psutil

from kvprobe.engines import sglang as dialect
from kvprobe.errors import ConfigError, TargetError
from kvprobe.targets.shadow import modeldir
from kvprobe.targets.shadow.envs import EngineEnv
from kvprobe.targets.shadow.pythonpath import kvprobe_pythonpath
from kvprobe.targets.shadow.settings import GPU_FREE_ENV, PLUGIN_LOG_PREFIX, WEIGHT_BYTES_ENV
from kvprobe.targets.shadow.sglang import compat
from kvprobe.targets.shadow.sglang import hybrid as sglang_hybrid
from kvprobe.theory.model.geometry import PRESETS, geometry_from_config, kv_bytes_per_token, weight_bytes
from kvprobe.theory.sglang.budget import SglangBudget, sglang_budget
from kvprobe.units import format_bytes, parse_count

# RSS of SGLang 0.5.23's processes besides the KV pool, measured here (Llama-3.1-8B config, idle):
# launcher 0.75 GB, scheduler 0.9 GB + the pool, detokenizer 0.73 GB, resource tracker 0.01 GB.
PROCESS_BYTES = int(2.5 * 2**30)
REQ_TO_TOKEN_BYTES = 4  # ReqToTokenPool: int32 [(max_running_requests + 1) x context_len] (memory_pool.py L406)
_INT_FLAGS = ("max-total-tokens", "context-length", "max-running-requests", "chunked-prefill-size", "page-size")


def _normalized_flags(flags: dict[str, object]) -> dict[str, object]:
    out = dict(flags)
    for name in _INT_FLAGS:
        if isinstance(out.get(name), str):
            out[name] = parse_count(out[name], key=f"flags.{name}")
    if isinstance(out.get("mem-fraction-static"), str):
        try:
            out["mem-fraction-static"] = float(out["mem-fraction-static"])
        except ValueError as err:
            raise ConfigError(f"expected a fraction such as 0.8, got {out['mem-fraction-static']!r}",
                              key="flags.mem-fraction-static") from err
    return out


def shadow_budget(req, flags: dict[str, object]) -> tuple[SglangBudget, int]:
    """The ledger's SGLang budget for this launch, and the bytes of KV per token (one rank)."""
    for name in ("tp-size", "pp-size", "dp-size"):
        if int(flags.get(name, 1)) != 1:
            raise ConfigError(f"the SGLang shadow runs one rank on a CPU; got {name} {flags[name]}",
                              key=f"flags.{name}")
    geom = geometry_from_config(req.config, req.model, dtype=flags.get("dtype"))
    kv = kv_bytes_per_token(geom, kv_cache_dtype=str(flags.get("kv-cache-dtype", "auto")))
    if req.gpu_memory_bytes is None and flags.get("max-total-tokens") is None:
        raise ConfigError("the SGLang shadow needs the pool's size: flags.max-total-tokens, or a declared GPU "
                          "memory (hardware.gpu_memory / --gpu-memory) to size it as that GPU would",
                          key="flags.max-total-tokens")
    ctx = flags.get("context-length") or geom.max_position_embeddings
    bud = sglang_budget(geom, kv, weights=weight_bytes(geom, engine="sglang"), gpu_memory_bytes=req.gpu_memory_bytes,
                        context_len=int(ctx), mem_fraction_static=flags.get("mem-fraction-static"),
                        chunked_prefill_size=flags.get("chunked-prefill-size"), page_size=flags.get("page-size"),
                        max_total_tokens=flags.get("max-total-tokens"),
                        max_running_requests=flags.get("max-running-requests"), estimates=dict(req.estimates),
                        model_config=req.config, hybrid_opts=sglang_hybrid.options(flags),
                        kv_cache_dtype=str(flags.get("kv-cache-dtype", "auto")), version=req.version)
    return bud, kv.total


def memory_needed(bud: SglangBudget, kv_bytes_per_token: int) -> dict[str, int]:
    """Real CPU memory the shadow takes: the KV pool (K and V buffers of every layer,
    "KV Cache is allocated ... K size, V size"; a hybrid model's pools, sglang_hybrid.pool_bytes), the
    request-to-token table, SGLang's processes."""
    pool = bud.max_total_num_tokens * kv_bytes_per_token if bud.pools is None else sglang_hybrid.pool_bytes(bud.pools)
    return {"kv_pool": pool,
            "req_to_token": (bud.max_running_requests + 1) * bud.context_len * REQ_TO_TOKEN_BYTES,
            "processes": PROCESS_BYTES}


def check_memory(need: dict[str, int], bud: SglangBudget, *, available: int | None = None) -> None:
    available = psutil.virtual_memory().available if available is None else available
    total = sum(need.values())
    if total <= available:
        return
    raise TargetError(
        f"the SGLang shadow does not fit in this machine's memory: its KV pool of {bud.max_total_num_tokens} "
        f"tokens takes {format_bytes(need['kv_pool'])} of real buffers, the request table "
        f"{format_bytes(need['req_to_token'])}, SGLang's processes ~{format_bytes(need['processes'])}: "
        f"{format_bytes(total)} needed, {format_bytes(available)} available. Give a smaller "
        f"flags.max-total-tokens (the pool is the same admission problem at any size), a smaller "
        f"flags.context-length, or a smaller declared GPU")


def _shadow_flags(req, flags: dict[str, object], bud: SglangBudget) -> dict[str, object]:
    out = dict(flags)
    out.setdefault("chunked-prefill-size", bud.chunked_prefill_size)
    if req.gpu_memory_bytes is not None:
        out.setdefault("mem-fraction-static", bud.fraction)
    return {**out, **dialect.SHADOW_FLAGS}


def command(req, env: EngineEnv) -> tuple[list[str], dict[str, str]]:
    flags = _normalized_flags(req.flags)
    bud, kv_per_token = shadow_budget(req, flags)
    check_memory(memory_needed(bud, kv_per_token), bud)
    weights, launch_flags = bud.weights, _shadow_flags(req, flags, bud)
    folder = modeldir.model_folder(req.model, sglang_hybrid.engine_config(req.config), env)
    environ = {"PYTHONPATH": str(kvprobe_pythonpath()), WEIGHT_BYTES_ENV: str(weights),
               **compat.launch_environ(env.version)}
    if req.model in PRESETS:  # a hub id: resolved offline from a private HF cache
        model_arg = req.model
        environ["HF_HOME"] = str(modeldir.hf_home(req.model, folder))
    else:
        model_arg = str(folder)
    if req.gpu_memory_bytes is not None:  # free before the weights: the card minus other residents
        free = req.gpu_memory_bytes - int(req.estimates.get("other_bytes", 0))
        environ[GPU_FREE_ENV] = str(free)
    port = "{port}" if not req.port else req.port  # {port}: the launcher picks a free one
    argv = dialect.launch_command(model_arg, launch_flags, host=req.host, port=port,
                                  binary=[str(env.python), "-m", dialect.LAUNCH_MODULE],
                                  served_model_name=str(flags.get("served-model-name") or req.served_model_name))
    return argv, environ


def parse_worker_log(text: str) -> dict:
    """What the plugin said in SGLang's log (lines starting with PLUGIN_LOG_PREFIX): that it
    acted, its time model, how the pool was sized, whether overlap scheduling ran; for hybrid models
    the window the model reported and the recurrent-state slots SGLang's `_handle_max_mamba_cache` set."""
    out: dict = {}
    for line in text.splitlines():
        _, sep, said = line.partition(PLUGIN_LOG_PREFIX + " ")
        if not sep:
            continue
        if said.startswith("plugin active"):
            out["plugin"] = "active"
            out["time_model"] = said.rpartition("time model ")[2].strip()
        elif said.startswith("pool sizing: "):
            out["pool_sizing"] = said.removeprefix("pool sizing: ").strip()
        elif said.startswith("forward: overlap scheduling "):
            out["overlap_scheduling"] = said.rpartition(" ")[2] == "on"
        elif said.startswith("sliding window: "):
            out["sliding_window"] = int(said.removeprefix("sliding window: ").split()[0])
        elif said.startswith("mamba state: "):
            words = said.split()
            out["mamba_slots"], out["mamba_cache_per_req"] = int(words[2]), int(words[5])
    return out
