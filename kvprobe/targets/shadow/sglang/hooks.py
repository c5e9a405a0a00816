"""The replacements of kvprobe's SGLang plugin (registered by `plugin.register`).

Each stands in for one piece that needs a GPU and sets exactly the attributes SGLang 0.5.23's own
code reads afterwards (file:line cited per function, wheel-relative `sglang/srt/...`). Imported
only inside the engine environment, when the hooks are applied.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from kvprobe.targets.shadow.settings import GPU_FREE_ENV, PLUGIN_LOG_PREFIX, TIME_MODEL_ENV, WEIGHT_BYTES_ENV
from kvprobe.targets.shadow.sglang import compat
from kvprobe.targets.shadow.sglang.device import DeviceTimeline, pseudo_token_ids, special_ids
from kvprobe.targets.shadow.sglang.hook_targets import applied, targets

logger = logging.getLogger("kvprobe.targets.shadow")

GIB = 1 << 30
# A budget no pool reaches: with --max-total-tokens and no declared GPU, SGLang's own
# `_apply_token_constraints` (kv_cache_configurator.py L3090-3117) then sets the pool to that value.
UNBOUNDED_BUDGET = 1 << 50


class ShadowModel(nn.Module):
    """What the runner reads from a loaded model: `forward`'s signature (`support_pp`,
    model_runner.py L508), the layer range (layer_setup.py `_resolve_pp_layer_range` defaults it to
    every layer when the model has no start_layer/end_layer), and the window of a sliding-window
    model (`window_of`)."""

    def __init__(self, config=None):
        super().__init__()
        self.config = config  # what a real model's get_attention_sliding_window_size reads

    def forward(self, input_ids, positions, forward_batch):
        raise RuntimeError("kvprobe shadow: the forward is replaced (TpModelWorker.forward_batch_generation)")


def _model_class(model_config):
    """The class SGLang would build for this config (model_loader/utils.py `get_model_architecture`
    L198-238), or None when it resolves none (the shadow then answers as a model without one)."""
    from sglang.srt.model_loader.utils import get_model_architecture

    try:
        return get_model_architecture(model_config)[0]
    except (ValueError, ImportError, RuntimeError):
        return None


def window_of(model_cls, model) -> int | None:
    """The sliding window the real model would report: its class's own
    `get_attention_sliding_window_size` run on the shadow (which carries the config the real model
    keeps as `self.config`). gpt-oss answers `sliding_window - 1` (models/gpt_oss.py L131-132,
    L1374-1375); models without the method leave it to ModelConfig (load_model_utils.py L144-157)."""
    method = getattr(model_cls, "get_attention_sliding_window_size", None)
    return None if method is None else method(model)


class _NoLoader:
    preloaded_weights_bytes = 0  # model_runner.py `preloaded_weights_bytes` (L933-941)


def _time_model():
    from kvprobe.theory.sim.steptime import TimeModel

    text = os.environ.get(TIME_MODEL_ENV)
    return TimeModel.decode(text) if text else TimeModel()


def replacements() -> list[tuple[str, object]]:
    """(dotted target, replacement function) for the six hooks, as the installed SGLang defines them:
    the names of `targets` are this module's."""
    return [(target, globals()[name]) for name, target in targets(compat.installed()).items()]


def check_applied() -> None:
    """SGLang logs a hook it could not apply and goes on with its own code (hook_registry.py
    `apply_hooks`); a shadow with a real piece left in would fail later and obscurely, so say so here."""
    missing = [target for target, fn in replacements() if not applied(target, fn)]
    if missing:
        raise RuntimeError(f"{PLUGIN_LOG_PREFIX} SGLang did not apply kvprobe's hooks on {', '.join(missing)} "
                           "(see 'Failed to apply hooks' above): this SGLang is not the version the plugin was "
                           "written for")


# ------------------------------------------------------------ ModelRunner.load_model (L1270-1440)
def load_model(self) -> None:
    """No weights: what the rest of `initialize()` (L705-745) and the pool sizing read."""
    self.loader = _NoLoader()
    self.model = ShadowModel(self.model_config.hf_config)
    model_cls = _model_class(self.model_config)
    own_window = getattr(model_cls, "get_attention_sliding_window_size", None) is not None
    if own_window:
        self.model.get_attention_sliding_window_size = lambda: window_of(model_cls, self.model)
    self.startup_weight_load = None
    self.sliding_window_size = compat.sliding_window_size(self.model, self.model_config)
    self.prefill_aware_swa = False
    self.dtype = self.model_config.dtype
    self.weight_load_mem_usage = 0.0
    self.weight_load_time = 0.0
    check_applied()
    logger.info("%s plugin active: no weights (%s, dtype %s); time model %s", PLUGIN_LOG_PREFIX,
                self.model_config.model_path, self.dtype, _time_model().encode())
    if self.sliding_window_size is not None:
        logger.info("%s sliding window: %d (%s)", PLUGIN_LOG_PREFIX, self.sliding_window_size,
                    f"{model_cls.__name__}.get_attention_sliding_window_size" if own_window else "model config")


# -------------------------------------- KVCacheConfigurator._profile_available_bytes (L2990-3060)
def profile_available_bytes(self, pre_model_load_memory) -> int:
    """The KV budget a GPU would leave, by SGLang's own formula (L3007, L3038, in GiB floats):
    available after the weights − free before them × (1 − mem_fraction_static). On the declared
    card, free before = its free memory (total − other residents, the ledger's `other_bytes`) and
    available after = that − the weights (kvprobe's ledger, theory/sglang/budget.py `sglang_budget`);
    mem_fraction_static is SGLang's resolved value, so `--mem-fraction-static` has its effect.
    With no declared GPU, a budget no pool reaches, so `--max-total-tokens` sizes the pool.
    A recurrent hybrid (Qwen3-Next) then takes its state slots out of that budget with SGLang's own
    `_handle_max_mamba_cache` (L3040-3041, called from the function this replaces)."""
    declared = os.environ.get(GPU_FREE_ENV)
    if not declared:
        logger.info("%s pool sizing: --max-total-tokens (no declared GPU; unbounded budget)", PLUGIN_LOG_PREFIX)
        return int(_less_mamba_state(self, UNBOUNDED_BUDGET / GIB) * GIB)
    free_gb = int(declared) / GIB
    weights_gb = int(os.environ.get(WEIGHT_BYTES_ENV, "0")) / GIB
    fraction = compat.mem_fraction_static(self)
    rest_gb = (free_gb - weights_gb) - free_gb * (1 - fraction)
    logger.info("%s pool sizing: declared GPU free %.2f GiB, weights %.2f GiB, mem_fraction_static %s "
                "-> KV budget %.2f GiB", PLUGIN_LOG_PREFIX, free_gb, weights_gb, fraction, rest_gb)
    rest_gb = _less_mamba_state(self, rest_gb)
    if rest_gb <= 0:  # SGLang's own message (L3043-3058), after the state pool as there
        need = 1 - (free_gb - weights_gb) / free_gb
        raise ValueError(f"Loaded weights leave no GPU memory for the KV cache under "
                         f"--mem-fraction-static={fraction}. Raise --mem-fraction-static above {need:.3f}")
    return int(rest_gb * GIB)


def _less_mamba_state(self, rest_gb: float) -> float:
    """The budget (GiB) after the recurrent-state pool, for a model with one: SGLang's own
    `_handle_max_mamba_cache` (L3229-3409) sets max_mamba_cache_size and returns the rest."""
    if getattr(self, "mambaish_config", None) is None:
        return rest_gb
    rest_gb = compat.less_mamba_state(self, rest_gb)
    logger.info("%s mamba state: %d slots of %d bytes", PLUGIN_LOG_PREFIX, compat.max_mamba_cache_size(self),
                self.mambaish_config.mamba2_cache_params.mamba_cache_per_req)
    return rest_gb


# ---------------------------------------------- ModelRunner.init_attention_backends (L1105-1130)
def init_attention_backends(self) -> None:
    """No kernels. The scheduler reads `attn_backend` only for optional attributes
    (scheduler.py L1675 `decide_needs_cpu_seq_lens`; L4151 `extend_attention_block_m`, absent -> 64)."""
    self.prefill_attention_backend_str = self.decode_attention_backend_str = "kvprobe-shadow"
    self.attn_backend = None
    self.decode_attn_backend = None
    self.decode_attn_backend_group = None


# ----------------------------------------------------- ModelRunner.init_cuda_graphs (L1170-1225)
def init_cuda_graphs(self, capture_decode_cuda_graph: bool = True) -> None:
    """Nothing captured: the attributes the real one sets, empty."""
    self.eager_runner = None
    self.prefill_cuda_graph_runner = None
    self.decode_cuda_graph_runner = None
    self.decode_cuda_graph_captured = False
    self.decode_cuda_graph_capture_bs = []
    self.graph_memory_usage = {}
    self.graph_time_usage = {}
    # 0.5.15.post1 and 0.5.16 set the scalar here (model_runner.py L946 / L845), which the scheduler's
    # get_internal_state reads (scheduler.py L3779 / L3885); 0.5.17 replaced it with graph_memory_usage.
    self.graph_mem_usage = 0.0


# ------------------------------------------ TpModelWorker.forward_batch_generation (tp_worker.py L622)
_device: DeviceTimeline | None = None
_special: frozenset[int] | None = None


PACE_STEPS = 2000  # one pace line per this many steps


def _report_pace() -> None:
    """Every PACE_STEPS steps, the real pace against the model's (idle gaps left out): above x1.00,
    SGLang's own work per step (scheduling, streaming) takes longer than the modelled step."""
    if _device.steps < PACE_STEPS:
        return
    steps, busy, model_s, waited = _device.window()
    logger.info("%s pace: %d steps in %.1f s, modelled %.1f s (x%.2f), %.1f s waiting for the modelled device",
                PLUGIN_LOG_PREFIX, steps, busy, model_s, busy / model_s if model_s else float("nan"), waited)


def _step_work(batch) -> tuple[int, int]:
    """(prefill tokens, decode sequences) of a ScheduleBatch: an extend batch computes
    extend_num_tokens; a mixed one carries its running requests as extends of length 1
    (`mix_with_running`, schedule_batch.py L3267-3360)."""
    mode = batch.forward_mode
    if mode.is_decode():
        return 0, batch.batch_size()
    if mode.is_mixed():
        decode = sum(1 for n in batch.extend_lens if n == 1)
        return int(batch.extend_num_tokens or 0) - decode, decode
    if mode.is_extend():
        return int(batch.extend_num_tokens or 0), 0
    return 0, 0


def forward_batch_generation(self, batch, forward_batch=None, pp_proxy_tensors=None, is_verify=False,
                             skip_attn_backend_init=None, *, capture_hidden_mode=None,
                             return_kv_loc_plan=False):
    """After the modelled step, what `process_batch_result` reads (tp_worker.py L695-765): one
    sampled id per request (the scheduler itself drops the one of a partial prefill chunk) and a
    logits output whose optional fields are empty (`copy_to_cpu`, managers/utils.py L168-210)."""
    global _device, _special
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult

    cfg = self.model_runner.model_config
    if _device is None:
        _device = DeviceTimeline(_time_model().step_seconds, overlap=self.enable_overlap)
        hf = cfg.hf_config
        _special = special_ids(*(getattr(hf, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")))
        logger.info("%s forward: overlap scheduling %s", PLUGIN_LOG_PREFIX, "on" if self.enable_overlap else "off")
    if batch is not None:
        _device.run(*_step_work(batch))
        seq_lens = batch.seq_lens
    else:  # the spec / PP paths hand a ForwardBatch
        seq_lens = forward_batch.seq_lens
        _device.run(0, len(seq_lens))
    _report_pace()
    ids = pseudo_token_ids(seq_lens.tolist(), cfg.vocab_size, _special)
    return GenerationBatchResult(logits_output=LogitsProcessorOutput(next_token_logits=None),
                                 next_token_ids=torch.tensor(ids, dtype=torch.int64, device=seq_lens.device),
                                 can_run_cuda_graph=False)


# --------------------------------------- SamplingBatchInfo.update_penalties (sampling_batch_info.py L410)
def update_penalties(self) -> None:
    """The penalizers' logit bias, built for the sampler: a float32 (batch x vocabulary) tensor every
    step (`_apply_pre_grammar_logits_transforms` adds it to the logits). With overlap scheduling it is
    built before each forward (`copy_for_forward`, L681, from `_forward_isolation`); on a GPU that is
    a kernel, here it is CPU work the size of the vocabulary — py-spy: 47% of the scheduler's time at
    16 requests with min_tokens (BatchedMinNewTokensPenalizer), halving the steps per second. There
    are no logits in the shadow, so no bias; the penalizers' own state is updated elsewhere
    (cumulate_output_tokens) and stop checks do not read it."""
    self.acc_additive_penalties = None
    self.acc_scaling_penalties = None
