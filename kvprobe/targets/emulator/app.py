"""One emulated engine: its configuration, scheduler, metrics, fault hooks, and the process around it.

`Emulator(settings)` builds everything (and refuses to start where the real engine would);
`serve(settings)` is the `kvprobe emulate` process: print the startup lines, bind, run until
SIGTERM/SIGINT, shut down within a second.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from aiohttp import web

from kvprobe.engines import get_dialect
from kvprobe.engines.sglang.hybrid_options import options
from kvprobe.engines.vllm.versions import published_gpu_memory_utilization
from kvprobe.errors import ConfigError
from kvprobe.targets.emulator.faults import Hooks, parse_faults, real_pool
from kvprobe.targets.emulator.metrics import SglangMetrics, VllmMetrics
from kvprobe.targets.emulator.runtime import Runtime
from kvprobe.theory.model.geometry import geometry_from_config, load_model_config
from kvprobe.theory.sglang.pools import SglangPools, sglang_layout, sglang_pools
from kvprobe.theory.sim.steptime import TimeModel
from kvprobe.theory.vllm.budget import plan_kv_tokens
from kvprobe.theory.vllm.hybrid.groups import sched_groups
from kvprobe.theory.vllm.hybrid.kv_cache_planning import VllmKVPlan, vllm_kv_plan
from kvprobe.theory.vllm.hybrid.kv_cache_spec import VllmOptions, release_options
from kvprobe.theory.vllm.releases import (
    WindowRules,
    active_seqs_refusal,
    default_block_size,
    running_cap,
    watermark_refusal,
    window_rules,
)


class Secret:
    """An API key that never shows itself: repr/str are redacted; `matches` compares digests in
    constant time (as both engines do)."""

    __slots__ = ("_digest",)

    def __init__(self, value: str):
        self._digest = hashlib.sha256(value.encode()).digest()

    def matches(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    def __repr__(self) -> str:
        return "Secret('<redacted>')"

    __str__ = __repr__


def _redacted(flags: dict[str, object]) -> dict[str, object]:
    return {k: ("<redacted>" if k == "api-key" and v is not None else v) for k, v in flags.items()}


@dataclass
class Settings:
    engine: str  # "vllm" | "sglang"
    model: str = "emulated/model"
    flags: dict[str, object] = field(default_factory=dict)  # real flag names (dashes) -> value
    version: str | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    time_model: TimeModel = field(default_factory=TimeModel)
    seed: int = 0
    faults: list[str] = field(default_factory=list)
    trace: str | None = None
    gpu_capability: str | None = None  # vLLM: the card's compute capability (None: a Hopper's, the ledger's default)

    def __repr__(self) -> str:  # the api key must not reach a log or a traceback through repr
        fields = {**self.__dict__, "flags": _redacted(self.flags)}
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def hybrid_plan(model: str, flags: dict, blocks: int, async_scheduling: bool,
                version: str | None = None, capability: str | None = None) -> VllmKVPlan | None:
    """vLLM's plan of a hybrid model's pool (theory/vllm/hybrid) when `model` is one kvprobe has a
    config.json for (a preset id or a path) and its layers are not all full attention; None otherwise:
    the uniform pool the flags describe, as before. Unknown layer kinds are an error naming the key."""
    try:
        cfg, source = load_model_config(model)
    except ConfigError:
        return None  # a served name only (emulated/model): no geometry to plan
    geom = geometry_from_config(cfg, model, source=source)
    if not geom.layers.hybrid:
        return None
    rules = window_rules(version) if version else WindowRules()  # no version: the newest release's rules
    opts = VllmOptions(cache_dtype=flags.get("kv-cache-dtype") or "auto", block_size=flags["block-size"],
                       max_num_batched_tokens=flags["max-num-batched-tokens"], async_scheduling=async_scheduling,
                       enable_prefix_caching=bool(flags["enable-prefix-caching"]),
                       **release_options(rules, geom, flags.get("gdn-prefill-backend"), capability))
    return vllm_kv_plan(geom, max_model_len=flags["max-model-len"], num_gpu_blocks_override=blocks, opts=opts,
                        refuse=False)


def sglang_hybrid_pools(model: str, flags: dict) -> SglangPools | None:
    """SGLang 0.5.23's pools for a hybrid model (theory/sglang/pools.py) when `model` is one kvprobe has a
    config.json for and SGLang splits its layers: a full pool of --max-total-tokens and a window pool
    beside it (gpt-oss), or a full pool over the full layers and recurrent-state slots (Qwen3-Next,
    with the radix cache off: one slot per running request, --max-running-requests of them; with it
    on, SGLang's state caching is not emulated and is refused). None otherwise: the one pool the
    flags describe (SGLang itself serves Gemma 2/3 and Mistral's window with one full pool)."""
    try:
        cfg, source = load_model_config(model)
    except ConfigError:
        return None  # a served name only (emulated/model): no geometry
    geom = geometry_from_config(cfg, model, source=source)
    if not geom.layers.hybrid:
        return None
    opts = options(flags)
    layout = sglang_layout(cfg, geom, opts)
    if layout.pool == "mamba" and not opts.disable_radix_cache:
        raise ConfigError(f"{model} keeps {len(layout.mamba_layer_ids)} recurrent (Gated DeltaNet) layers in "
                          "SGLang's state-slot pool: the emulator models it with the radix cache off only (add "
                          "--disable-radix-cache; the SGLang shadow serves it either way: kvprobe shadow sglang)",
                          key="--disable-radix-cache")
    if layout.pool == "full":
        return None
    return sglang_pools(cfg, geom, context_len=flags["context-length"], max_total_tokens=flags["max-total-tokens"],
                        opts=opts)


class Emulator:
    def __init__(self, settings: Settings):
        from kvprobe.theory.schedsim import SglangConfig, SimRequest, VllmConfig, make_scheduler

        self.settings = s = settings
        self.engine = s.engine
        self.dialect = d = get_dialect(s.engine)
        self.version = s.version or d.DEFAULT_VERSION
        self.faults = parse_faults(s.faults)
        f = {name: (s.flags[name] if s.flags.get(name) is not None else flag.default)
             for name, flag in d.FLAGS.items() if flag.emulated}
        key = f.pop("api-key", None) or (os.environ.get(d.API_KEY_ENV) if d.API_KEY_ENV else None)
        self.api_key = Secret(key) if key else None  # kept out of self.flags: /server_info shows flags
        self.flags = f
        self.model = s.model
        self.served_model_name = f.get("served-model-name") or s.model
        self.created = int(time.time())
        if self.engine == "vllm":
            if s.flags.get("block-size") is None:  # the release's own default (16; 64 from 0.34.0)
                f["block-size"] = default_block_size(self.version)
            self.published_utilisation = published_gpu_memory_utilization(
                self.version, s.flags.get("gpu-memory-utilization"))
            blocks = f["num-gpu-blocks-override"]
            if not blocks or blocks < 2:
                raise ConfigError("--num-gpu-blocks-override is required (the pool in blocks, >= 2)",
                                  key="--num-gpu-blocks-override")
            self.num_blocks_reported, self.block_size = blocks, f["block-size"]
            self.max_model_len = f["max-model-len"]
            self.refusal = d.startup_refusal(blocks, self.block_size, self.max_model_len)
            # a flag this release's `vllm serve` does not have, or a cap it refuses, as the ledger reads them
            self.argument_refusal = (watermark_refusal(self.version, f["watermark"])
                                     or active_seqs_refusal(self.version, f["max-num-seqs"], f["max-num-active-seqs"]))
            try:
                self.kv_plan = plan = hybrid_plan(s.model, f, blocks, d.async_scheduling_default(self.version)
                                                  if f["async-scheduling"] is None else f["async-scheduling"],
                                                  self.version, s.gpu_capability)
            except ConfigError as err:  # a GDN prefill kernel a CUDA GPU has not: the layer's build fails
                if err.key != "gdn_prefill_backend":
                    raise
                self.kv_plan = plan = None
                self.refusal = self.refusal or str(err).removeprefix(f"{err.key}: ")
            window = window_rules(self.version)
            groups = ()
            if plan is not None:  # a hybrid model: its groups share the pool, as vLLM plans them
                self.block_size, self.refusal, groups = plan.block_size, plan.refusal, sched_groups(plan)
            self.capacity = None if plan is None else (plan_kv_tokens(plan, self.version), plan.max_concurrency)
            config = VllmConfig(num_gpu_blocks=real_pool(blocks, self.faults), block_size=self.block_size,
                                max_num_seqs=running_cap(f["max-num-seqs"], f["max-num-active-seqs"]),
                                max_num_batched_tokens=f["max-num-batched-tokens"],
                                max_model_len=self.max_model_len, enable_prefix_caching=f["enable-prefix-caching"],
                                enable_chunked_prefill=f["enable-chunked-prefill"],
                                policy=d.policy(self.version, reserve_full_isl=f["scheduler-reserve-full-isl"]),
                                watermark=f["watermark"],
                                async_scheduling=d.async_scheduling_default(self.version)
                                if f["async-scheduling"] is None else f["async-scheduling"], groups=groups,
                                window_admission_cap=window.admission_cap, window_in_flight=window.in_flight,
                                sparse_retention=window.sparse_retention, free_order=window.free_order)
            cap, unit = config.max_num_seqs, self.block_size
            self.metrics_enabled = True
            self.stats_enabled = not f["disable-log-stats"]
            self.metrics = VllmMetrics(self.served_model_name, d.cache_config_labels(
                num_gpu_blocks=blocks, block_size=self.block_size, max_model_len=self.max_model_len,
                enable_prefix_caching=f["enable-prefix-caching"], num_gpu_blocks_override=blocks,
                user_specified_block_size=s.flags.get("block-size") is not None,
                gpu_memory_utilization=self.published_utilisation, capacity=self.capacity))
        else:
            m = f["max-total-tokens"]
            if not m or m < 2:
                raise ConfigError("--max-total-tokens is required (the pool in tokens)", key="--max-total-tokens")
            self.pool_tokens_reported, self.max_model_len = m, f["context-length"]
            self.page_size, self.refusal, self.argument_refusal = f["page-size"], None, None
            self.pools = pools = sglang_hybrid_pools(s.model, f)  # a window pool or state slots, or None
            window = swa_tokens = slots = None
            self.max_running = d.resolve_max_running_requests(m, self.max_model_len, f["max-running-requests"])
            if pools is not None:
                window, swa_tokens, slots = pools.layout.sliding_window_size, pools.swa_tokens, pools.mamba_slots
                self.max_running = pools.max_running_requests  # the state slots cap it (resolve_max_num_reqs)
            self.max_req_input_len = d.max_req_input_len(self.max_model_len, m)
            config = SglangConfig(max_total_num_tokens=real_pool(m, self.faults), page_size=self.page_size,
                                  max_running_requests=self.max_running,
                                  chunked_prefill_size=f["chunked-prefill-size"],
                                  max_prefill_tokens=f["max-prefill-tokens"], context_len=self.max_model_len,
                                  disable_radix_cache=f["disable-radix-cache"], policy=d.policy(self.version),
                                  schedule_conservativeness=f["schedule-conservativeness"],
                                  overlap=not f["disable-overlap-schedule"], sliding_window_size=window,
                                  swa_pool_tokens=None if swa_tokens is None else real_pool(swa_tokens, self.faults),
                                  **d.scheduler_rules(self.version))
            cap, unit = self.max_running, self.page_size
            self.metrics_enabled = self.stats_enabled = bool(f["enable-metrics"])
            self.metrics = SglangMetrics(self.served_model_name, max_total_num_tokens=m,
                                         context_len=self.max_model_len, page_size=self.page_size,
                                         decode_log_interval=f["decode-log-interval"], swa_pool_tokens=swa_tokens,
                                         mamba_slots=slots)
        self.config = config
        self.scheduler = make_scheduler(config)
        self.hooks = Hooks(self.scheduler, self.faults, running_cap=cap, unit=unit, clock=time.monotonic)
        self.runtime = Runtime(self.scheduler, s.time_model, self.metrics, self.hooks, make_request=SimRequest,
                               seed=s.seed, trace_path=s.trace)
        self._loop_task: asyncio.Task | None = None
        self.t_serving: float | None = None  # monotonic time the server started serving (metrics-drop-after)

    def __repr__(self) -> str:
        return f"Emulator({self.engine} {self.version}, model={self.model!r}, api_key={self.api_key!r})"

    # --- what the engine prints and reports
    def startup_lines(self) -> list[str]:
        d, f = self.dialect, self.flags
        if self.engine == "vllm":
            # `vllm serve` lists the arguments it was given that differ from its parser's defaults
            # first (startup.py L94-96); the emulator compares with the dialect's defaults.
            given = {"model_tag": self.model, **{d.FLAGS[k].dest: v for k, v in f.items() if v != d.FLAGS[k].default}}
            return [d.non_default_args_line(given),
                    *d.startup_lines(num_blocks=self.num_blocks_reported, block_size=self.block_size,
                                     max_model_len=self.max_model_len,
                                     max_num_batched_tokens=f["max-num-batched-tokens"], version=self.version,
                                     capacity=self.capacity)]
        return d.startup_lines(max_total_num_tokens=self.pool_tokens_reported,
                               chunked_prefill_size=f["chunked-prefill-size"],
                               max_prefill_tokens=f["max-prefill-tokens"], max_running_requests=self.max_running,
                               context_len=self.max_model_len,
                               swa_tokens=None if self.pools is None else self.pools.swa_tokens)

    def serving_lines(self, host: str, port: int) -> list[str]:
        if self.engine == "vllm":
            return [self.dialect.serving_line(host, port)]
        return self.dialect.serving_lines(host, port)

    def dev_server_info(self) -> dict:
        """vLLM's dev-mode /server_info (served when VLLM_SERVER_DEV_MODE=1, as the real server)."""
        f = self.flags
        return self.dialect.dev_server_info_body(
            max_num_seqs=f["max-num-seqs"], max_num_batched_tokens=f["max-num-batched-tokens"],
            enable_chunked_prefill=f["enable-chunked-prefill"], watermark=f["watermark"],
            max_num_active_seqs=f["max-num-active-seqs"], reserve_full_isl=f["scheduler-reserve-full-isl"],
            block_size=self.block_size,
            num_gpu_blocks=self.num_blocks_reported, num_gpu_blocks_override=self.num_blocks_reported,
            enable_prefix_caching=f["enable-prefix-caching"], max_model_len=self.max_model_len, model=self.model,
            served_model_name=self.served_model_name,
            user_specified_block_size=self.settings.flags.get("block-size") is not None,
            gpu_memory_utilization=self.published_utilisation, gdn_prefill_backend=f["gdn-prefill-backend"])

    def server_info(self) -> dict:
        # Every server argument, as SGLang's ServerArgs.resolved_dict (server_args.py L316-333): the
        # modelled ones with the emulator's values, the rest (no GPU to resolve them) at their defaults.
        args = {flag.dest: flag.default for name, flag in self.dialect.FLAGS.items() if name != "api-key"}
        args.update({k.replace("-", "_"): v for k, v in self.flags.items()})
        args.update(model_path=self.model, served_model_name=self.served_model_name,
                    context_length=self.max_model_len, max_running_requests=self.flags["max-running-requests"])
        return self.dialect.server_info_body(args=args, max_total_num_tokens=self.pool_tokens_reported,
                                             max_req_input_len=self.max_req_input_len,
                                             effective_max_running=self.max_running, version=self.version)

    # --- lifecycle inside a running event loop
    def start_loop(self) -> None:
        self.t_serving = time.monotonic()
        self._loop_task = asyncio.get_running_loop().create_task(self.runtime.run())
        self._loop_task.add_done_callback(_report_loop_death)

    async def stop_loop(self) -> None:
        self.runtime.stop()
        if self._loop_task is not None:
            try:
                await asyncio.wait_for(self._loop_task, 1.0)
            except (TimeoutError, asyncio.CancelledError):
                self._loop_task.cancel()
        self.runtime.close()


def _report_loop_death(task: asyncio.Task) -> None:
    """A dead engine loop would leave every stream waiting: say so loudly instead of hanging silently."""
    if not task.cancelled() and task.exception() is not None:
        import traceback

        err = task.exception()
        print("ERROR: emulator engine loop died:\n" + "".join(traceback.format_exception(err)), file=sys.stderr,
              flush=True)


async def start_server(emu: Emulator, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Bind and serve `emu` in the running loop; returns the runner and the bound port."""
    from kvprobe.targets.emulator.server import build_app

    # handler_cancellation: a client that disconnects cancels its handler -> its request is aborted
    runner = web.AppRunner(build_app(emu), handler_cancellation=True, access_log=None, shutdown_timeout=0.25)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    emu.start_loop()
    bound = site._server.sockets[0].getsockname()[1]  # port 0 -> the one the OS chose
    return runner, bound


async def stop_server(emu: Emulator, runner: web.AppRunner) -> None:
    await emu.stop_loop()
    await runner.cleanup()


def serve(settings: Settings) -> int:
    """The `kvprobe emulate` process. Startup lines go to stdout (flushed) before the socket is bound,
    like the real engines: once /health answers, the capacity line is already in the log."""
    emu = Emulator(settings)
    if emu.argument_refusal:  # the engine's argument parser stops it before anything starts (exit 2)
        print(emu.argument_refusal, file=sys.stderr, flush=True)
        return 2
    if emu.refusal:  # vLLM refuses to start (kv_cache_planning._check_enough_kv_cache_memory)
        print(f"ValueError: {emu.refusal}", file=sys.stderr)
        print(emu.dialect.STARTUP_FAILED, file=sys.stderr, flush=True)
        return 1
    for line in emu.startup_lines():
        print(line)
    sys.stdout.flush()
    port = settings.port if settings.port is not None else emu.dialect.DEFAULT_PORT
    return asyncio.run(_serve(emu, settings.host, port))


async def _serve(emu: Emulator, host: str, port: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        runner, bound = await start_server(emu, host, port)
    except OSError as err:
        print(f"ERROR: cannot bind {host}:{port}: {err}", file=sys.stderr, flush=True)
        return 1
    gc.collect()
    gc.freeze()  # long-lived setup objects leave the collector's view
    gc.set_threshold(50_000, 20, 20)  # per-token garbage is short-lived: collect young gen less often
    for line in emu.serving_lines(host, bound):
        print(line)
    sys.stdout.flush()
    await stop.wait()
    await asyncio.wait_for(stop_server(emu, runner), 1.0)
    print(f"kvprobe emulator (pid {os.getpid()}): shut down", flush=True)
    return 0
