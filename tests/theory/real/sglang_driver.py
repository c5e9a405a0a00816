"""Drive SGLang 0.5.23's (or 0.5.19-0.5.22's) own Scheduler through a closed loop, step by step (no server, no model).

Run by tests/theory/test_real_sglang.py with the python of an SGLang 0.5.23 environment (not
kvprobe's): argv[1] is a JSON list of cases, each with the model folder, the scheduler's flags, the
shape (optionally an `eos_after`: every request samples EOS as that output), the arrival steps and
the number of steps. SGLang is imported once; each case runs in a forked child of its own, so every
Scheduler starts from a fresh process state (its distributed and runtime context are per process).
The real `Scheduler` is built as `run_scheduler_process` builds it
(scheduler.py L6310-6345: publish, then `Scheduler(server_args, port_args)`), with the five pieces
that need a GPU replaced — the same five the shadow target replaces (kvprobe/targets/shadow/sglang/):
the weights, GPU memory profiling (so --max-total-tokens sizes the pool),
attention backends, CUDA graphs, and the forward, which returns one pseudo token per request.
Everything that decides admission is SGLang's code: `get_next_batch_to_run` with PrefillAdder and
`schedule_policy`, `ReqToTokenPool` and the token allocator, the radix cache, `update_running_batch`
with `check_decode_mem`/`retract_decode`, the new_token_ratio tracker, `process_batch_result`.
The loop is `event_loop_overlap` (or `event_loop_normal` without overlap), L2026-2135, with
requests handed to `handle_generate_request` instead of arriving over ZMQ, and finished requests
read from what `stream_output` sends to the detokenizer; their users resubmit before the next step.

Prints one line per case, `TRACE {"trace": ..., "seconds": ...}` (or `{"error": ...}`): per step,
after it, [running (admitted, not finished, not waiting: the chunked request included), waiting, used
tokens (max_total - available - evictable, as pool_stats_observer.py L235-245 counts them; a hybrid
sliding-window model: the full pool's, then the window pool's), retractions so far, new_token_ratio],
the pool sizes and max_running_requests. A case may add `server_args` (they win over those derived from
its config) and use a hybrid model folder: the model stand-in answers
`get_attention_sliding_window_size()` as the real model class would.
"""
import inspect
import json
import os
import sys
import time
import traceback
from array import array
from collections import deque

os.environ.setdefault("SGLANG_PLUGINS", "none")  # kvprobe's shadow plugin, if installed, stays out
import torch  # noqa: E402
from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sglang.srt.managers.tp_worker import TpModelWorker  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402

try:  # noqa: E402
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
except ImportError:  # 0.5.19: publish(server_args, role=...) alone (runtime_context.py L1465)
    from sglang.srt.runtime_context import publish
    SpawnRanks = None
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import PortArgs, ServerArgs  # noqa: E402
from torch import nn  # noqa: E402


# ---------------------------------------------------------------- the five replacements
class _NoModel(nn.Module):
    def forward(self, input_ids, positions, forward_batch):
        raise RuntimeError("the forward is replaced (TpModelWorker.forward_batch_generation)")


class _NoGptOss(_NoModel):
    """gpt-oss's model class answers the window itself (models/gpt_oss.py L131-132, L1374), so
    resolve_sliding_window_size (load_model_utils.py L144-157) takes `sliding_window - 1`; other
    classes (Llama 4, Mistral) have no such method and the config decides."""

    def __init__(self, hf_config):
        super().__init__()
        self.window = hf_config.sliding_window - 1

    def get_attention_sliding_window_size(self):
        return self.window


class _NoLoader:
    preloaded_weights_bytes = 0  # model_runner.py L933-941


def load_model(self):  # ModelRunner.load_model (model_runner.py L1270): what initialize() reads after it
    from sglang.srt.model_executor.model_runner_components.load_model_utils import resolve_sliding_window_size

    hf = self.model_config.hf_text_config
    model = _NoGptOss(hf) if getattr(hf, "model_type", "") == "gpt_oss" else _NoModel()
    self.loader, self.model, self.startup_weight_load = _NoLoader(), model, None
    self.sliding_window_size = resolve_sliding_window_size(self.model, self.model_config)
    self.prefill_aware_swa, self.dtype = False, self.model_config.dtype
    self.weight_load_mem_usage = self.weight_load_time = 0.0


def profile_available_bytes(self, pre_model_load_memory):  # kv_cache_configurator.py L2990
    return 1 << 50  # no pool reaches it: --max-total-tokens sizes the pool (_apply_token_constraints)


def init_attention_backends(self):  # model_runner.py L1105
    self.prefill_attention_backend_str = self.decode_attention_backend_str = "none"
    self.attn_backend = self.decode_attn_backend = self.decode_attn_backend_group = None


def init_cuda_graphs(self, capture_decode_cuda_graph=True):  # model_runner.py L1170
    self.eager_runner = self.prefill_cuda_graph_runner = self.decode_cuda_graph_runner = None
    self.decode_cuda_graph_captured, self.decode_cuda_graph_capture_bs = False, []
    self.graph_memory_usage, self.graph_time_usage = {}, {}


EOS_AT = None  # set by each case: the sequence length at which EOS is sampled


def forward_batch_generation(self, batch, forward_batch=None, pp_proxy_tensors=None, is_verify=False,
                             skip_attn_backend_init=None, *, capture_hidden_mode=None, return_kv_loc_plan=False):
    """tp_worker.py L622: one sampled id per request (the scheduler drops a partial chunk's); the
    EOS id (config.json's) as output number `eos_after`, sampled at sequence length P + eos_after - 1."""
    ids = [2 if n == EOS_AT else 1000 + n % 251 for n in batch.seq_lens.tolist()]
    return GenerationBatchResult(logits_output=LogitsProcessorOutput(next_token_logits=None),
                                 next_token_ids=torch.tensor(ids, dtype=torch.int64), can_run_cuda_graph=False)


ModelRunner.load_model = load_model
KVCacheConfigurator._profile_available_bytes = profile_available_bytes
ModelRunner.init_attention_backends = init_attention_backends
ModelRunner.init_cuda_graphs = init_cuda_graphs
TpModelWorker.forward_batch_generation = forward_batch_generation

retracted = 0
_retract = ScheduleBatch.retract_decode


def retract_decode(self, *a, **k):
    global retracted
    out = _retract(self, *a, **k)
    retracted += len(out[0])
    return out


ScheduleBatch.retract_decode = retract_decode

from sglang.srt.managers.scheduler import Scheduler  # noqa: E402


# ---------------------------------------------------------------- one case
def run_case(args: dict) -> dict:
    global EOS_AT
    EOS_AT = None if args.get("eos_after") is None else args["P"] + args["eos_after"] - 1
    cfg = args["config"]
    kwargs = dict(
        model_path=args["model_dir"], device="cpu", skip_tokenizer_init=True, attention_backend="torch_native",
        log_level="error", max_total_tokens=cfg["max_total_num_tokens"], page_size=cfg["page_size"],
        max_running_requests=cfg["max_running_requests"], chunked_prefill_size=cfg["chunked_prefill_size"],
        max_prefill_tokens=cfg["max_prefill_tokens"], context_length=cfg["context_len"],
        disable_radix_cache=cfg["disable_radix_cache"], disable_overlap_schedule=not cfg["overlap"],
        schedule_conservativeness=cfg["schedule_conservativeness"])
    # a case's own server args win: gpt-oss asserts a GPU attention backend (arg_groups/model_hook.py
    # L530-540) though none is built here (init_attention_backends is replaced); the window pool's
    # --swa-full-tokens-ratio; max_running_requests None lets SGLang derive it
    kwargs.update(args.get("server_args", {}))
    server_args = ServerArgs(**kwargs)
    port_args = PortArgs.init_new(server_args)
    sched = new_scheduler(server_args, port_args)
    assert sched.max_total_num_tokens == cfg["max_total_num_tokens"], sched.max_total_num_tokens

    finished: list[str] = []


    class Detokenizer:
        """Stands in for the ZMQ socket to the detokenizer (output_streamer.py L235): finished rids."""

        def send_output(self, payload, *rest):
            for rid, reason in zip(payload.rids, getattr(payload, "finished_reasons", None) or [], strict=False):
                if reason is not None:
                    finished.append(rid)


    sched.output_streamer.send_to_detokenizer = Detokenizer()

    P, O, K, N = args["P"], args["O"], args["K"], args["users"]  # noqa: E741
    count = 0


    def submit() -> None:
        """kvprobe's workload_prompt structure: K shared ids, a unique id, the common filler."""
        nonlocal count
        prompt = ([7 + (i * 7919) % 30011 for i in range(K)] + [50000 + count]
                  + [13 + (i * 104729) % 30011 for i in range(P - K - 1)])
        params = SamplingParams(max_new_tokens=O, ignore_eos=args["ignore_eos"])
        params.normalize(None)
        params.verify(sched.model_config.vocab_size)
        sched.handle_generate_request(TokenizedGenerateReqInput(
            input_text=None, input_ids=array("q", prompt), input_embeds=None, mm_inputs=None, token_type_ids=None,
            sampling_params=params, return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
            token_ids_logprob=None, stream=False, rid=f"u{count}"))
        count += 1


    # ---------------------------------------------------------------- the loop (event_loop_overlap / _normal)
    overlap = sched.enable_overlap
    sched.enable_skip_finishing_decode = overlap  # as event_loop_overlap sets them (L2063-2066)
    sched.result_queue = deque()


    def pop_and_process() -> None:
        batch, result = sched.result_queue.popleft()
        sched.process_batch_result(batch, result)


    arrivals, trace, done, nxt = args["arrivals"], [], 0, 0
    started = time.time()
    for t in range(args["steps"]):
        while nxt < N and arrivals[nxt] <= t:
            submit()
            nxt += 1
        plan = sched.get_next_batch_to_run(running_batch=sched.running_batch, last_batch=sched.last_batch)
        sched.running_batch, batch = plan.running_batch, plan.batch_to_run
        if overlap:
            disable = sched.is_disable_overlap_for_batch(batch, last_batch=sched.last_batch)
            if disable:
                pop_and_process()
            result = None
            if batch:
                result = sched.run_batch(batch)
                sched.result_queue.append((batch.copy(), result))
            if sched.last_batch:
                if not disable:
                    pop_and_process()
            elif batch is None:
                sched.on_idle()
            sched.launch_batch_sample_if_needed(result, batch)
        elif batch:
            sched.process_batch_result(batch, sched.run_batch(batch))
        else:
            sched.on_idle()
        sched.last_batch = batch
        done += len(finished)
        waiting = len(sched.waiting_queue)
        row = [count - done - waiting, waiting, *used_tokens(sched), retracted,
               round(sched.new_token_ratio_tracker.current, 9)]
        trace.append(row)
        for _ in finished:
            submit()
        finished.clear()
    alloc = sched.token_to_kv_pool_allocator
    sizes = [alloc.size_full, alloc.size_swa] if hasattr(alloc, "size_swa") else [sched.max_total_num_tokens]
    return {"trace": trace, "seconds": time.time() - started, "pool_sizes": sizes,
            "max_running_requests": sched.max_running_requests}


def new_scheduler(server_args, port_args):
    """`Scheduler` as run_scheduler_process builds it. 0.5.19 takes the ranks as arguments
    (scheduler.py L424-435: gpu_id, tp_rank, moe_ep_rank, pp_rank, attn_cp_rank, moe_dp_rank,
    dp_rank; publish at L5551) and its event loop opens `schedule_stream`, a no-op on a CPU
    (L1773-1775), which run_batch reads; 0.5.21 on take (server_args, port_args) and the ranks
    from publish."""
    if SpawnRanks is None:
        publish(server_args, role="scheduler")
    else:
        publish(server_args, role="scheduler", ranks=SpawnRanks(
            world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), dp_rank=None, gpu_id=0))
    if len(inspect.signature(Scheduler.__init__).parameters) == 3:
        return Scheduler(server_args, port_args)
    sched = Scheduler(server_args, port_args, 0, 0, 0, 0, 0, 0, None)
    sched.schedule_stream = sched.device_module.Stream(priority=0)
    sched.schedule_stream.synchronize = lambda: None
    return sched


def used_tokens(sched) -> list[int]:
    """Used tokens per pool as pool_stats_observer.py counts them: one pool, capacity - available
    - evictable (L235-245); hybrid SWA, the full pool then the window pool (`_get_swa_token_info`
    L312-330, allocator/swa.py L222-229)."""
    alloc, tree = sched.token_to_kv_pool_allocator, sched.tree_cache
    if not hasattr(alloc, "swa_available_size"):
        return [sched.max_total_num_tokens - alloc.available_size() - tree.evictable_size()]
    return [alloc.size_full - alloc.full_available_size() - tree.full_evictable_size(),
            alloc.size_swa - alloc.swa_available_size() - tree.swa_evictable_size()]


def in_child(args: dict) -> dict:
    """`run_case` in a forked child: SGLang's per-process state stays out of the next case."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = run_case(args)
        except BaseException:  # noqa: BLE001 - the parent reports it for this case
            out = {"error": traceback.format_exc()}
        with os.fdopen(w, "w") as fh:
            fh.write(json.dumps(out))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(data) if data else {"error": f"the case's process ended with status {status} and no result"}


for case in json.loads(sys.argv[1]):
    print("TRACE " + json.dumps(in_child(case)), flush=True)
