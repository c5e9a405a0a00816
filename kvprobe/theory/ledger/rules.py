"""Which release's rule the ledger applied, per figure, and which release changes it has no model
for in this configuration (the engines' tables: `kvprobe.theory.vllm.unmodelled`,
`kvprobe.theory.sglang.unmodelled`). The ledger prints the first as its "release rules" table and
the second as "not modelled since / before ..." lines; where one of those moves the pool, the start
or the admission, the admission is not predicted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvprobe.releases import version_tuple
from kvprobe.theory.admission import policy_rule
from kvprobe.theory.model.layers import LINEAR
from kvprobe.theory.sglang.releases import scheduler_rule_text
from kvprobe.theory.sglang.unmodelled import SglangFacts
from kvprobe.theory.sglang.unmodelled import unmodelled as sglang_unmodelled
from kvprobe.theory.unmodelled import Unmodelled, blocks_prediction
from kvprobe.theory.vllm.hybrid.kv_cache_spec import hybrid_block_size
from kvprobe.theory.vllm.releases import (
    ACTIVE_SEQS_FROM,
    ACTIVE_SEQS_RULE,
    ALIGN_ON_GIVEN_BLOCK_FROM,
    ASYNC_DEFAULT_FROM,
    BLOCK_SIZE_64_FROM,
    KV_SIZE_LINE_FROM,
    SEQS_TO_TOKEN_BUDGET_FROM,
    WATERMARK_FROM,
    default_block_size,
    legacy_kv_size_line,
    seqs_lowered_to_token_budget,
    window_rules,
)
from kvprobe.theory.vllm.unmodelled import VllmFacts, first_release
from kvprobe.theory.vllm.unmodelled import unmodelled as vllm_unmodelled

# The first vLLM release whose defaults the ledger's batch tiers are (engine/arg_utils.py
# get_batch_defaults: the >= 160 GiB tier; the unmodelled table's V10 row).
VLLM_BATCH_TIERS_FROM = first_release("V10")


@dataclass
class ReleaseRules:
    """The rules applied (aspect -> what, with the release) and the changes not modelled."""

    applied: list[tuple[str, str]] = field(default_factory=list)
    unmodelled: list[Unmodelled] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return [r.line() for r in self.unmodelled]

    @property
    def blocks_prediction(self) -> bool:
        return blocks_prediction(self.unmodelled)

    def why_not_predicted(self) -> str | None:
        """The ledger's reason for no admission prediction, or None when the rows leave it standing."""
        if not self.blocks_prediction:
            return None
        return "; ".join(r.line() for r in self.unmodelled if r.effect != "figure")


# A hybrid model's window groups under a release's rules (theory/vllm/releases.py WindowRules): what the
# full-sequence check charges them, and the blocks a request holds in flight.
WINDOW_ADMISSION, WINDOW_IN_FLIGHT, HYBRID_POOL = "window admission", "window blocks in flight", "hybrid block pool"
# A Gated DeltaNet layer's blocks a request (releases.py MAMBA_CHECKPOINTS_FROM): both the capacity line and
# what a request holds move with it.
MAMBA_CHECKPOINTS = "Mamba checkpoint blocks"
# The aspects of the release rules that set what vLLM's "GPU KV cache size" line says of a pool (its
# semantics, and the blocks a window group's max-length request is counted for): `kvprobe diff` names them
# where that line moved beyond its pool.
KV_SIZE_LINE = "KV cache size figure"
CAPACITY_LINE_ASPECTS = (KV_SIZE_LINE, WINDOW_IN_FLIGHT, MAMBA_CHECKPOINTS)
# The block size a release takes when none is given moves the pool's blocks and every request's: named
# wherever a figure moved with it.
BLOCK_SIZE = "block size"
# The aspects that move admission itself without a change of policy: a window group's charge in the
# full-sequence check and its blocks in flight (release-changes.md V4, V5), what a preempted request finds of
# itself in the hybrid pool (releases.py UNHASHED_FIRST_FROM, SPARSE_RETENTION_FROM), and the block size.
ADMISSION_ASPECTS = (WINDOW_ADMISSION, WINDOW_IN_FLIGHT, HYBRID_POOL, MAMBA_CHECKPOINTS, BLOCK_SIZE)


def _checkpoint_rule(window, inputs, plan_opts) -> str:
    """The release's checkpoint rule, and whether this card's GDN prefill kernel takes the block: only
    FlashInfer's does (qwen_gdn_linear_attn.py L688-696 in 0.33.0; kv_cache_spec.resolve_gdn_prefill_backend)."""
    text = window.checkpoint_text()
    if not window.mamba_checkpoints or plan_opts is None or plan_opts.mamba_cache_mode != "align":
        return text
    card = (f"compute capability {inputs.gpu_capability}" if inputs.gpu_capability else
            inputs.gpu_arch if inputs.gpu_arch else "a Hopper, sm90: no card declared")
    why = f"--gdn-prefill-backend {inputs.gdn_prefill_backend} on {card}" if inputs.gdn_prefill_backend else card
    if plan_opts.gdn_prefill_backend == "flashinfer":
        return f"{text}; here FlashInfer's GDN prefill kernel ({why})"
    kernel = {"triton": "Triton/FLA", "cutedsl": "CuteDSL"}[plan_opts.gdn_prefill_backend]
    return (f"two state blocks, no checkpoint block nor grid: the GDN prefill kernel is {kernel} ({why}), and only "
            "FlashInfer's takes one (0.33.0 on: qwen_gdn_linear_attn.py _resolve_gdn_prefill_backend)")


def _block_size_rule(inputs, geom, bud, version: str, plan_opts) -> str:
    """The block size and where it came from: given, this release's default, or (a Mamba hybrid) the
    default raised until an attention page holds a Mamba state — so a diff of 0.33.0 against 0.34.0 names
    the default's move behind a hybrid's 544 -> 576. A size given (or published by the engine) that is what
    the release would take anyway is told as the release's."""
    default = default_block_size(version, mla=geom.attention == "mla")
    since = ".".join(map(str, BLOCK_SIZE_64_FROM))
    why = f"16 before vLLM {since}.0, 64 from it: config/cache.py L185; MLA 64 on every release"
    own = default
    if plan_opts is not None and geom.layers.count(LINEAR):
        own = hybrid_block_size(geom, dataclasses.replace(plan_opts, block_size=default))[0]
        planned = hybrid_block_size(geom, plan_opts)[0]
        if inputs.block_size and planned != inputs.block_size:
            step = ("max(16, the block given)" if plan_opts.align_on_given_block else
                    f"16 (before vLLM {'.'.join(map(str, ALIGN_ON_GIVEN_BLOCK_FROM))}.0)")
            return (f"{planned} tokens: {inputs.block_size} given, raised to the smallest multiple of {step} whose "
                    "attention page holds a Mamba state (platforms/interface.py _align_hybrid_block_size; "
                    "models/config.py through 0.19.1)")
    if inputs.block_size and inputs.block_size != own:
        return f"{inputs.block_size} tokens, given"
    if own != default:
        return (f"{own} tokens, this release's default {default} ({why}) raised to the smallest multiple whose "
                "attention page holds a Mamba state (platforms/interface.py _align_hybrid_block_size)")
    return f"{bud.block_size} tokens, this release's default ({why})"


def vllm_release_rules(inputs, geom, bud, *, version: str, seqs: int, caching: bool,
                       policy: str | None, plan_opts=None) -> ReleaseRules:
    """The vLLM rules the ledger applied for `version`, and the rows of its unmodelled table these
    inputs reach (`inputs`: LedgerInputs; `bud`: the VllmBudget; `plan_opts`: a hybrid's VllmOptions)."""
    facts = VllmFacts(
        version=version, kinds=geom.layers.kinds, max_model_len_auto=inputs.max_model_len == -1, max_num_seqs=seqs,
        max_num_batched_tokens_given=inputs.max_num_batched_tokens is not None,
        gpu_memory_bytes=inputs.gpu_memory_bytes, prefix_caching=caching, num_blocks=bud.num_blocks,
        num_gpu_blocks_override=inputs.num_gpu_blocks_override, refused=bud.refusal is not None,
        pool_after_warmup=bud.source == "reservation")
    applied = []
    if bud.rules:
        applied.append(("memory profile", bud.rules))
    batch = "given" if inputs.max_num_seqs and inputs.max_num_batched_tokens else (
        f"the GPU-tier defaults of vLLM {VLLM_BATCH_TIERS_FROM}-0.33.0 (engine/arg_utils.py get_batch_defaults) "
        "for what was not given")
    if not inputs.max_num_seqs:
        since = ".".join(map(str, SEQS_TO_TOKEN_BUDGET_FROM))
        batch += (f"; max_num_seqs lowered to the token budget where that is smaller (vLLM {since} on, "
                  "engine/arg_utils.py)" if seqs_lowered_to_token_budget(version) else
                  f"; max_num_seqs not lowered to the token budget (before vLLM {since}: a smaller budget is "
                  "refused)")
    applied.append(("max_num_seqs / max_num_batched_tokens", batch))
    applied.append((BLOCK_SIZE, _block_size_rule(inputs, geom, bud, version, plan_opts)))
    if inputs.max_num_active_seqs is not None:
        effect = (f"refused: vLLM {version} has no such flag" if version_tuple(version) < ACTIVE_SEQS_FROM
                  else f"RUNNING capped at {min(seqs, inputs.max_num_active_seqs)}")
        applied.append(("max_num_active_seqs", f"{ACTIVE_SEQS_RULE}: {effect}"))
    async_default = "on" if version_tuple(version) >= ASYNC_DEFAULT_FROM else "off"
    since = ".".join(map(str, ASYNC_DEFAULT_FROM))
    applied.append(("scheduling", f"{'async' if inputs.async_scheduling else 'sync'} (the default of this release: "
                                  f"{async_default}; on by default from {since}.0, config/scheduler.py)"))
    since = ".".join(map(str, KV_SIZE_LINE_FROM))
    applied.append((KV_SIZE_LINE, f"num_blocks // groups x the smallest block size (before vLLM {since}, "
                                            "v1/core/kv_cache_utils.py _report_kv_cache_config)"
                    if legacy_kv_size_line(version) else
                    f"max_concurrency x max_model_len (vLLM {since} on, v1/core/kv_cache_utils.py "
                    "get_kv_cache_capacity)"))
    if bud.plan is not None:
        window = window_rules(version)
        applied.append((WINDOW_ADMISSION, window.admission_text()))
        applied.append((WINDOW_IN_FLIGHT, window.in_flight_text()))
        applied.append((HYBRID_POOL, window.pool_text()))
        if geom.layers.count(LINEAR):
            applied.append((MAMBA_CHECKPOINTS, _checkpoint_rule(window, inputs, plan_opts)))
    if inputs.watermark and version_tuple(version) >= WATERMARK_FROM:  # kv_cache_manager.py L163, 0.24.0
        applied.append(("watermark", f"{int(inputs.watermark * bud.num_blocks)} blocks ({inputs.watermark:g} x "
                                     f"{bud.num_blocks}) kept free when a request is admitted while others are "
                                     f"scheduled (vLLM {'.'.join(map(str, WATERMARK_FROM))}.0 on)"))
    if policy is not None:
        applied.append(("admission policy", f"{policy}: {policy_rule(policy)}"))
    return ReleaseRules(applied, vllm_unmodelled(facts))


def sglang_release_rules(inputs, bud, *, version: str, ctx: int, policy: str | None) -> ReleaseRules:
    """The SGLang rules the ledger applied for `version`, and the rows of its unmodelled table these
    inputs reach (`bud`: the SglangBudget)."""
    facts = SglangFacts(
        version=version, max_total_num_tokens=bud.max_total_num_tokens, context_len=ctx, page_size=bud.page_size,
        dp=inputs.dp, max_running_requests=inputs.max_running_requests, prompt_tokens=inputs.prompt_tokens,
        output_tokens=inputs.output_tokens)
    applied = [("mem_fraction_static", f"{bud.fraction_source}")]
    applied.append(("max_running_requests", "resolve_max_num_reqs of 0.5.14-0.5.23: a given value capped at "
                                            "M // 2; the default clamp(M / context_len x 512, 2048, 4096), "
                                            "capped at M // 2"))
    applied.append(("max_new_tokens", "clipped to context and memory (max_new_tokens_for_memory, 0.5.21 on)"))
    if bud.pools is not None:
        applied.append(("hybrid pools", "SGLang 0.5.20-0.5.23's (earlier releases refused)"))
    applied.append(("scheduler loop", scheduler_rule_text(version)))
    if policy is not None:
        applied.append(("admission policy", f"{policy}: {policy_rule(policy)}"))
    return ReleaseRules(applied, sglang_unmodelled(facts))
