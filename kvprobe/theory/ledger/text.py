"""The ledger as a person reads it: one table per section (model, budget, capacity, request,
admission), the arithmetic in the "how" column, and the engine's refusal as a finding; a fleet's
ledger adds the fleet's lines after its replica's."""

from __future__ import annotations

from kvprobe.tables import render_table
from kvprobe.theory.admission import policy_rule
from kvprobe.theory.ledger.fleet import FleetLedger
from kvprobe.theory.ledger.sections import Ledger
from kvprobe.theory.model.mxfp4 import DEFAULT_GPU_ARCH
from kvprobe.theory.vllm.budget import VllmBudget
from kvprobe.theory.vllm.memory_profile import FREE_MEMORY_REFUSAL
from kvprobe.units import format_bytes


def render_ledger(led: Ledger | FleetLedger) -> str:
    """The text of a ledger, or of a fleet's: its replica's ledger, then the fleet's lines."""
    if isinstance(led, FleetLedger):
        return render_ledger(led.replica) + "\n\n" + render_fleet(led)
    sections = _render_sections(led)
    if led.release_rules:
        sections.append(render_table(["release rules", "applied"], [list(r) for r in led.release_rules],
                                     align="ll"))
    if led.not_modelled:
        sections.append("\n".join(led.not_modelled))
    if led.refusal is not None:
        sections.append(_refusal_text(led))
    return "\n\n".join(sections)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _render_sections(led: Ledger) -> list[str]:
    inp, g, kv, b, c = led.inputs, led.model.geometry, led.model.kv, led.budget, led.capacity
    vllm = inp.engine == "vllm"
    ep = inp.tp * inp.dp if inp.enable_expert_parallel and vllm else 1
    par = f"TP{inp.tp} PP{inp.pp} DP{inp.dp}" + (f" EP{ep}" if ep > 1 else "")
    kv_note = f"{kv.layers_per_rank} layers x {kv.per_layer_main} B"
    if kv.indexer:
        kv_note += f" + {kv.indexer_layers_per_rank} indexer layers x {kv.per_layer_indexer} B"
    model_rows = [
        ["model", g.name, led.model.source],
        ["attention", g.attention, f"{g.num_layers} layers, {g.num_kv_heads} KV heads" if g.attention == "gqa"
         else f"latent {g.kv_lora_rank}+{g.qk_rope_head_dim}, not split by TP"],
        ["parameters", g.param_count, f"{g.dtype}"
         + (f", {g.quantization} checkpoint" if g.quantization not in ("", "mxfp4") else "")
         + (", MXFP4 experts" if g.quantized_mxfp4 else "")],
        ["weights per rank", format_bytes(led.model.weight_bytes), par + (
            f", experts as {inp.engine} allocates them on {inp.gpu_arch or DEFAULT_GPU_ARCH}"
            if g.quantized_mxfp4 else "")],
        ["KV bytes per token per rank", kv.total, f"{kv.dtype}: {kv_note}"],
    ]
    if g.layers.hybrid:  # the bytes per token above count every attention layer as full
        model_rows.append(["layer kinds", "hybrid", f"{g.layers.describe()}: pooled per KV cache group below"])
    out = [render_table(["model", "value", "how"], model_rows, title=f"capacity ledger: {inp.engine} "
                        f"{led.engine_version}", align="lrl")]
    out.append(render_table(["budget", "value", "how"], _budget_rows(led), align="lrl"))
    unit = "blocks" if vllm else "pages"
    cap_rows = [
        [f"pool ({unit})", c.num_blocks, _logged_blocks(led) if vllm
         else f"max_total_num_tokens / page_size {c.block_size}"],
        [f"usable {unit}", c.usable_blocks, "minus the null block" if vllm else "-"],
        ["block size (tokens)", c.block_size, f"{format_bytes(c.bytes_per_block)} per block"],
        ["pool (tokens)", c.kv_tokens, "GPU KV cache size" if vllm else "max_total_num_tokens"],
        ["upper bound (tokens)", c.kv_tokens_upper, "weights only subtracted" if vllm else "profiled pool"],
        ["max length", c.max_model_len, "max_model_len" if vllm else "context_len"],
        ["concurrency at max length", f"{c.max_concurrency_at_max_model_len:.2f}x",
         "Maximum concurrency" if vllm else "pool / context_len"],
        ["max running", c.max_running, ("max_num_active_seqs" if led.inputs.max_num_active_seqs else "max_num_seqs")
         if vllm else "max_running_requests"],
        ["token budget per step", c.token_budget, "max_num_batched_tokens" if vllm else "chunked_prefill_size"],
    ]
    if not vllm:
        cap_rows.append(["max_req_input_len", b.max_req_input_len, "min(ctx-1, pool-1) - 5"])
    for g in c.groups:  # vLLM: one pool, several block tables per request; SGLang: a pool per kind
        if "tokens" in g:
            cap_rows.append([f"  {g['group']}", g["tokens"], f"tokens; {g['layers']} layers x "
                             f"{g['bytes_per_token'] // max(g['layers'], 1)} B per token"])
            continue
        if "slots" in g:
            cap_rows.append([f"  {g['group']}", g["slots"], f"slots, one per running request; {g['layers']} "
                             f"layers, {format_bytes(g['bytes_per_slot'])} per slot"])
            continue
        cap_rows.append([f"  group: {g['group']}", g["blocks_per_request"],
                         f"blocks per max-length request; {g['copies']} group(s), {g['layers']} layers"])
    out.append(render_table(["capacity", "value", "how"], cap_rows, align="lrl"))
    r = led.request
    if r is not None:
        req_rows = [
            ["prompt + output tokens", f"{r.prompt_tokens} + {r.output_tokens}", f"length limit {r.length_limit}"],
            [f"{r.unit} to admit", r.blocks_admission, _admit_how(led) if vllm
             else "prompt + min(O, 4096) reserved"],
            [f"peak {r.unit}", r.blocks_peak, "ceil((P+O-1)/B)" if vllm else "P + O - 1"],
            ["requests the pool holds at peak", (c.usable_blocks if vllm else c.kv_tokens) // r.blocks_peak,
             f"usable {r.unit} // peak"],
        ]
        if r.groups and not vllm:  # SGLang's pools: the full pool's figures above; each pool's below
            for g in r.groups:
                req_rows.append([f"  {g['group']}", f"{g['blocks_admission']} / {g['blocks_peak']}",
                                 f"tokens charged at admission / held at peak; mean {g['blocks_mean']:g} "
                                 "(one request alone)"])
        elif r.groups:
            req_rows[2][2] = "sum over groups of each group's peak (one request alone)"
            # the groups peak at different moments, and a closed loop interleaves requests: the
            # no-preemption limit below is higher (admission.py simulates it)
            req_rows[3][2] = "usable blocks // peak: every request at every group's peak at once"
            for g in r.groups:
                req_rows.append([f"  {g['group']}", f"{g['blocks_admission']} / {g['blocks_peak']}",
                                 f"blocks to admit / peak; mean {g['blocks_mean']:g} over its life"])
        out.append(render_table(["request", "value", "how"], req_rows, align="lrl"))
    out.append(_admission_text(led))
    return out


def _admit_how(led: Ledger) -> str:
    """What a vLLM release needs free to admit a prompt: its first chunk before 0.19, the whole prompt from it."""
    policy = led.admission.policy if led.admission is not None else None
    if policy == "vllm-0.11":
        return "prompt blocks; admitted once its first chunk, min(P, token budget), fits (before 0.19)"
    return "prompt blocks (full ISL)"


def _budget_rows(led: Ledger) -> list[list[object]]:
    b = led.budget
    est = getattr(b, "estimates", {}) or {}

    def how(key: str, measured: str) -> str:
        return f"estimate ({measured})" if key in est else "given"

    if isinstance(b, VllmBudget):
        return _vllm_budget_rows(b, how)
    total = "-" if b.total_bytes is None else format_bytes(b.total_bytes)
    held = est.get("other_bytes") if b.total_bytes is not None else None  # a shared card: SGLang's pool is
    free = [["free at start", format_bytes(b.total_bytes - held), f"{format_bytes(held)} held by others"]] \
        if held else []  # sized from the free memory, its defaults from the total
    return [
        ["GPU memory", total, "per GPU: SGLang's defaults" if held else "per GPU, assumed empty before load"],
        *free,
        ["mem_fraction_static", b.fraction, b.fraction_source],
        ["reserved (MiB)", b.reserved_mib, f"chunked_prefill {b.chunked_prefill_size}, decode graph bs "
         f"{b.cuda_graph_max_bs}" if b.reserved_mib is not None else "-"],
        ["- weights", format_bytes(b.weights), "from config.json"],
        ["= KV pool", None if b.kv_pool_bytes is None else format_bytes(b.kv_pool_bytes),
         "free x fraction - weights" if held else "total x fraction - weights"],
    ]


def _logged_blocks(led: Ledger) -> str:
    if led.budget.source == "reservation":  # 0.34.0 logs the pool measured after warm-up
        return "the reservation's blocks (the engine logs the pool it measures after warm-up)"
    return "num_gpu_blocks as logged (null block included)"


def _vllm_budget_rows(b: VllmBudget, how) -> list[list[object]]:
    """The memory split, then the pool labelled by what really sized it: the profiled split, the
    bytes given by --kv-cache-memory-bytes, or the blocks given by --num-gpu-blocks-override."""
    total = "-" if b.total_bytes is None else format_bytes(b.total_bytes)
    rows: list[list[object]] = [["GPU memory", total, "per GPU"]]
    if b.source == "kv_cache_memory_bytes":
        rows.append(["= KV pool", format_bytes(b.kv_pool_bytes), "kv-cache-memory-bytes (given: no memory "
                     "profiling, gpu_memory_utilization not used)"])
        return rows
    profiled = None if b.kv_pool_bytes is None else format_bytes(b.kv_pool_bytes)
    if b.source == "num_gpu_blocks_override" and b.requested_bytes is None:  # no GPU memory: no split
        return rows + [["= KV pool", format_bytes(b.num_blocks * b.bytes_per_block),
                        f"num-gpu-blocks-override: {b.num_blocks} blocks x {format_bytes(b.bytes_per_block)}"]]
    graph_how = how("cudagraph_bytes", "graph pool") if b.cudagraph_subtracted else \
        f"not subtracted by this release (estimate {format_bytes(b.cudagraph)} logged only)"
    rows += [
        ["memory profile", b.rules.split(" rules: ")[0], b.rules.split(" rules: ")[-1]] if b.rules else None,
        ["gpu_memory_utilization", b.fraction, "requested = ceil(total x fraction)"
         if "ceil(" in b.rules or not b.rules else "requested = total x fraction"],
        ["requested", None if b.requested_bytes is None else format_bytes(b.requested_bytes), "-"],
        ["- weights", format_bytes(b.weights), "from config.json"],
        ["- other", format_bytes(b.other), how("other_bytes", "CUDA context, NCCL")],
        ["- activation peak", format_bytes(b.activation), how("activation_bytes", "profile run")],
        ["- CUDA graphs", format_bytes(b.cudagraph if b.cudagraph_subtracted else 0), graph_how],
    ]
    rows = [r for r in rows if r is not None]
    if b.source == "num_gpu_blocks_override":
        rows.append(["(profiled pool)", profiled, "what profiling gives; replaced by the override"
                     if profiled else "no GPU memory given: not profiled"])
        rows.append(["= KV pool", format_bytes(b.num_blocks * b.bytes_per_block),
                     f"num-gpu-blocks-override: {b.num_blocks} blocks x {format_bytes(b.bytes_per_block)}"])
    elif b.source == "reservation":
        rows.append(["= KV pool", profiled, "the reservation the profile run gives (the engine's 'Available KV "
                     "cache memory'); the pool is measured after warm-up: not modelled"])
    else:
        rows.append(["= KV pool", profiled, "profiled: requested - weights - other - activation - graphs"])
    rows.append(["KV pool upper bound", None if b.kv_pool_bytes_upper is None else format_bytes(b.kv_pool_bytes_upper),
                 "requested - weights"])
    return rows


def _refusal_hint(led: Ledger) -> str:
    start = led.startup
    fits = start["largest_max_model_len"]
    if start["message"].startswith(FREE_MEMORY_REFUSAL):  # refused before any pool: no pool to fit
        return "other processes hold the difference: free the card or lower gpu-memory-utilization"
    if fits:
        return f"the largest max-model-len that fits this pool: {fits} (--max-model-len {fits})"
    if led.inputs.engine == "sglang":
        return "no KV pool at all: the weights take what the fraction leaves"
    return "no max-model-len fits: the pool holds no usable block"


def _refusal_text(led: Ledger) -> str:
    return (f"finding: {led.inputs.engine} {led.engine_version} would refuse to start with this configuration:\n"
            f"  {led.startup['message']}\n  {_refusal_hint(led)}")


def _admission_text(led: Ledger) -> str:
    a = led.admission
    if a is None:
        why = "give --prompt-tokens and --output-tokens" if led.request is None else \
            "admission model (kvprobe.theory.admission) not available"
        if led.refusal is not None:
            why = "the engine would not start with this configuration"
        if led.not_predicted is not None:
            why = led.not_predicted
        return f"admission: not predicted ({why})"
    limit_how = a.how or "running when saturated, per replica"
    if a.limit_mean is not None and a.limit_mean != a.limit:
        limit_how = f"most running at once (time average {a.limit_mean:g}); " + limit_how
    rows = [["policy", a.policy, f"{a.method}; the release rule: {policy_rule(a.policy)}"]]
    if led.inputs.engine == "vllm":
        mode = "async" if a.async_scheduling else "sync"
        rows.append(["scheduling", mode, "AsyncScheduler: slots one step earlier, frees one step later"
                     if a.async_scheduling else "allocate and free within the step"])
    if a.shared_prefix_tokens:
        caching = led.scheduler_config.enable_prefix_caching if led.inputs.engine == "vllm" \
            else not led.scheduler_config.disable_radix_cache
        rows.append(["shared prompt prefix", a.shared_prefix_tokens,
                     ("prefix caching on: " + ("full blocks shared" if led.inputs.engine == "vllm"
                                               else "radix tree, whole pages shared"))
                     if caching else "prefix caching off: nothing shared"])
    rows += [
        ["admission limit", a.limit, limit_how],
        ["no-preemption limit", a.no_preemption_limit,
         "every request at every group's peak at once: clean whatever the arrivals"
         if a.clean_in_closed_loop is not None else "largest N with no waiting, no preemption"],
        ["usage gauge at the limit", _pct(a.usage_at_limit), "what the dashboard shows"],
    ]
    if a.clean_in_closed_loop is not None:  # after the bound a probe is held to: what it may find above it
        rows.insert(-1, ["clean in the closed loop", a.clean_in_closed_loop,
                         a.clean_in_closed_loop_how + "; users arriving in phase find less, down to the bound"])
    if led.inputs.dp > 1:
        rows.append(["admission limit, all replicas", a.limit * led.inputs.dp, f"DP{led.inputs.dp}"])
    if a.users is not None:
        rows += [["users", a.users, "closed loop"],
                 ["running at users", a.running, a.users_how or "steady state"],
                 ["waiting at users", a.waiting, "steady state"],
                 ["preemptions per 1k steps", a.preemption_rate, "at users"]]
    table = render_table(["admission", "value", "how"], rows, align="lrl")
    group = getattr(a, "binding_group", "")
    binding = f"{a.binding} ({group})" if group and a.binding == "kv" else a.binding
    return f"{table}\nbinding limit: {binding}"


def render_fleet(led: FleetLedger) -> str:
    a, R = led.admission, led.replicas
    rows = [["replicas", R, f"router: sglang-router, policy {led.policy}"],
            ["admission limit, one replica", f"{led.replica_limit:g}", f"{led.replica.admission.binding} binds"],
            ["admission limit, fleet", f"{float(a.limit):g}", f"{R} x {led.replica_limit:g}"],
            ["no-preemption limit, fleet", a.no_preemption_limit,
             "exact: ceil(N/R) <= one replica's" if led.even else "even-split figure; this policy queues earlier"]]
    s = led.at_limit
    if s is not None:
        split = " / ".join(f"{x:.1f}" for x in s.inflight)
        rows += [[f"at N = {s.users}: in flight per replica", split, "exact (even split)" if s.exact else
                  f"simulated, {s.steps} steps"],
                 [f"at N = {s.users}: fleet running / waiting", f"{s.fleet_running:.1f} / {s.fleet_waiting:.1f}",
                  f"imbalance {s.imbalance:.1f} (max - min in flight)"],
                 [f"at N = {s.users}: what binds", s.binding,
                  {"client": "nothing waits", "router": "a replica queues while another has room",
                   "replica": "every replica at its own limit"}[s.binding]]]
    return "Fleet\n" + render_table(["", "value", "how"], rows)
