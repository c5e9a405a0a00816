"""Drive vLLM 0.33.0's own Scheduler / AsyncScheduler through a closed loop (no server, no model).

Run by tests/theory/test_real_vllm.py (and test_real_vllm_hybrid.py) with the python of a vLLM
0.33.0 environment (not kvprobe's): argv[1] is JSON with the pool, the shape, the arrival steps and
the window (or a list of such objects: one JSON line with a list of answers). The recipe is vLLM's
tests/v1/core/utils.py: a fake KV layout — one full-attention group, or the hybrid groups given
(`groups`: kind, copies, window, block_size and checkpoint as
kvprobe.theory.vllm.hybrid.kv_cache_manager.KVGroup), each a one-layer group of the engine's own spec
class — `schedule()`, a ModelRunnerOutput with one token per request that completes its sequence,
`update_from_output`; async keeps a queue of two outputs as EngineCore.step_with_batch_queue does.
Counts are read after update_from_output, where Prometheus samples them; finished users resubmit
before the next step. Prints one JSON line: the window's means of running, waiting and the usage
gauge, the preemptions, and with `trace` the running, waiting and free blocks after every step.
"""
import inspect
import json
import os
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# 0.34.0's CPU platform needs Triton, kept with no GPU driver only when this is set and empty
# (kvprobe/targets/shadow/vllm/target.py TRITON_REQUIRED_FROM); harmless on earlier releases
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreEventType  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402


def accepted(cls, **kw):
    """The keywords `cls` takes: the driver also runs 0.18.1's scheduler, whose configs lack some of
    0.33.0's fields (watermark, hash_block_size, prefix_cache_retention_interval), and 0.34.0's, whose
    ModelRunnerOutput has no req_id_to_index."""
    params = inspect.signature(cls).parameters
    return {k: v for k, v in kw.items() if k in params}


def run(args: dict) -> dict:
    """One closed loop; see the module doc."""
    G, B, P, O, N = args["blocks"], args["block_size"], args["P"], args["O"], args["users"]  # noqa: E741
    mml, asyn, K = args["mml"], args["async"], args["K"]
    arrivals, t0, t_end = args["arrivals"], args["t0"], args["t_end"]
    mc = ModelConfig(model=args["model_dir"], dtype="float16", skip_tokenizer_init=True, max_model_len=mml)
    sc = SchedulerConfig(**accepted(
                         SchedulerConfig, max_num_seqs=args["max_num_seqs"],
                         max_num_batched_tokens=args["max_num_batched_tokens"],
                         max_model_len=mml, is_encoder_decoder=False, enable_chunked_prefill=True,
                         async_scheduling=asyn, watermark=args.get("watermark", 0.0)),
                         # 0.19.0+ only, and never filtered out: asked of 0.18.1 it fails loudly
                         **({} if args.get("reserve_full_isl") is None
                            else {"scheduler_reserve_full_isl": args["reserve_full_isl"]}))
    cc = CacheConfig(block_size=B, enable_prefix_caching=args["caching"])
    groups = args.get("groups") or [{"kind": "full"}]
    if any(g["kind"] == "mamba" for g in groups):
        cc.mamba_cache_mode = "align" if args["caching"] else "none"  # MambaModelConfig (models/config.py L750-787)
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, parallel_config=ParallelConfig())
    # The CPU platform turns async scheduling off in the config (platforms/cpu.py L346-348); a GPU keeps it, and
    # with it two batches in flight (VllmConfig.max_in_flight_tokens, the window groups' admission cap).
    vc.scheduler_config.async_scheduling = asyn

    def spec(g: dict):
        kw = dict(block_size=g.get("block_size") or B, num_kv_heads=1, head_size=1, dtype=torch.float32)
        if g["kind"] == "full":
            return FullAttentionSpec(**kw)
        if g["kind"] == "sliding":
            return SlidingWindowSpec(**kw, sliding_window=g["window"])
        if g["kind"] == "chunked":
            return ChunkedLocalAttentionSpec(**kw, attention_chunk_size=g["window"])
        # `checkpoint`: the prefill checkpoint alignment of FlashInfer's GDN prefill (one checkpoint block,
        # layers/mamba/gdn/qwen_gdn_linear_attn.py L739-750)
        ckpt = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=g["checkpoint"]) \
            if g.get("checkpoint") else {}
        return MambaSpec(block_size=kw["block_size"], shapes=((1,),), dtypes=(torch.float32,),
                         mamba_cache_mode=cc.mamba_cache_mode, **ckpt)

    specs = [spec(g) for g in groups for _ in range(g.get("copies", 1))]
    kvc = KVCacheConfig(**accepted(
        KVCacheConfig, num_blocks=G, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
        prefix_cache_retention_interval=getattr(cc, "prefix_cache_retention_interval", None)))
    cc.num_gpu_blocks = G
    if hasattr(kv_cache_utils, "resolve_kv_cache_block_sizes"):  # as EngineCore (core.py L176-188)
        sched_block, hash_block = kv_cache_utils.resolve_kv_cache_block_sizes(kvc, vc)
    else:  # 0.18.1: one block size for scheduling and hashing
        sched_block = hash_block = B
    cls = AsyncScheduler if asyn else Scheduler  # AsyncScheduler hands its keywords on to Scheduler
    sched = cls(**accepted(Scheduler, vllm_config=vc, kv_cache_config=kvc, block_size=sched_block,
                           hash_block_size=hash_block, log_stats=True,
                           structured_output_manager=StructuredOutputManager(vc)))
    sched.use_v2_model_runner = False
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_block, hash_fn)
    count = 0

    def submit() -> None:
        """kvprobe's workload_prompt structure: K shared ids, a unique id, the common filler."""
        nonlocal count
        prompt = ([7 + (i * 7919) % 30011 for i in range(K)] + [50000 + count]
                  + [13 + (i * 104729) % 30011 for i in range(P - K - 1)])
        sp = SamplingParams(max_tokens=O, min_tokens=O, ignore_eos=True)
        sp.update_from_generation_config({}, 2)
        sched.add_request(Request(request_id=f"u{count}", prompt_token_ids=prompt, sampling_params=sp,
                                  pooling_params=None, block_hasher=hasher))
        count += 1

    queue = []
    preemptions = window_preemptions = reported = 0
    sums = [0, 0, 0.0, 0]
    trace = [] if args.get("trace") else None
    nxt = 0
    started = time.time()
    pool = sched.kv_cache_manager.block_pool
    for t in range(t_end):
        while nxt < N and arrivals[nxt] <= t:
            submit()
            nxt += 1
        so = sched.schedule()
        preempted = len(so.preempted_req_ids or ())
        preemptions += preempted
        window_preemptions += preempted if t >= t0 else 0
        ids = list(so.num_scheduled_tokens)
        tokens = [[] if sched.requests[r].is_prefill_chunk else [7] for r in ids]
        # req_id_to_index only where the release has it (0.33.0 v1/outputs.py L271; gone in 0.34.0)
        queue.append((so, ModelRunnerOutput(**accepted(
            ModelRunnerOutput, req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=tokens, logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))))
        finished = 0
        if not asyn or len(queue) == 2:
            outs = sched.update_from_output(*queue.pop(0))
            finished = sum(1 for eco in outs.values() for o in eco.outputs if o.finish_reason is not None)
            # what vllm:num_preemptions counts: PREEMPTED events, delivered with a request's next output
            # (v1/metrics/stats.py IterationStats.update_from_events)
            reported += sum(1 for eco in outs.values() for o in eco.outputs for e in (o.events or ())
                            if e.type == EngineCoreEventType.PREEMPTED) if t >= t0 else 0
        running, waiting = sched.get_request_counts()
        if trace is not None:
            trace.append((running, waiting, pool.get_num_free_blocks()))
        if t >= t0:
            sums[0] += running
            sums[1] += waiting
            sums[2] += sched.kv_cache_manager.usage
            sums[3] += 1
        for _ in range(finished):
            submit()
    w = max(sums[3], 1)
    return {"running": sums[0] / w, "waiting": sums[1] / w, "usage": sums[2] / w, "steps": t_end,
            "seconds": time.time() - started, "trace": trace, "preemptions": preemptions,
            "window_preemptions": window_preemptions, "window_reported_preemptions": reported}


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    # a list of loops runs in this one process: vLLM's imports cost more than a loop
    print(json.dumps([run(a) for a in job] if isinstance(job, list) else run(job)))
