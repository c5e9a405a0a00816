"""Run inside the SGLang 0.5.23 environment: SGLang's own pool configurator for a hybrid model.

`python sglang_hybrid_facts.py < requests.json` prints a JSON list, one answer per request
{model (folder), args (ServerArgs fields), rest_gb}. For each, SGLang resolves its server args
(model overrides included) and its ModelConfig from the folder, the window size is resolved the way
the model runner does (`resolve_sliding_window_size`, with gpt-oss's own
`get_attention_sliding_window_size`), and a real `KVCacheConfigurator` sizes the pools from
`rest_gb` — the budget `_profile_available_bytes` holds after the non-static slack:
`_handle_max_mamba_cache` for recurrent models, then `config_from_budget` and
`resolve_max_num_reqs`. Nothing is allocated and no model is loaded.
"""

from __future__ import annotations

import json
import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator  # noqa: E402
from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo  # noqa: E402
from sglang.srt.model_executor.model_runner_components.load_model_utils import (  # noqa: E402
    resolve_sliding_window_size,
)
from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (  # noqa: E402
    SpecAuxHiddenStateConfig,
)
from sglang.srt.runtime_context import get_parallel, get_schedule, publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402


def _model_stub(mc):
    """The loaded model's only attribute the runner reads for the window: gpt-oss has its own."""
    if mc.hf_config.architectures[0] == "GptOssForCausalLM":
        from sglang.srt.models.gpt_oss import get_attention_sliding_window_size
        return types.SimpleNamespace(get_attention_sliding_window_size=lambda: get_attention_sliding_window_size(
            mc.hf_text_config))
    return object()


def answer(req: dict) -> dict:
    sa = ServerArgs(model_path=req["model"], device="cpu", skip_tokenizer_init=True, **req.get("args", {}))
    try:
        publish(sa, role="scheduler")
    except AssertionError as err:  # e.g. a strategy this platform cannot run
        return {"error": str(err)}
    mc = ModelConfig.from_server_args(sa)
    n = mc.num_hidden_layers
    info = ModelLayerInfo(start_layer=0, end_layer=n, num_effective_layers=n,
                          swa_attention_layer_ids=mc.swa_attention_layer_ids,
                          full_attention_layer_ids=mc.full_attention_layer_ids)
    window = resolve_sliding_window_size(_model_stub(mc), mc)
    kvc = KVCacheConfigurator(
        device="cpu", gpu_id=0, attn_dp_size=get_parallel().attn_dp_size, pp_size=1, pp_group=None,
        model=None, model_config=mc, server_args=sa, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto",
        model_dtype=torch.bfloat16, page_size=get_schedule().page_size or 1, sliding_window_size=window,
        spec_algorithm=SpeculativeAlgorithm.NONE, is_draft_worker=False, post_capture_kv_active=False,
        spec_aux_config=SpecAuxHiddenStateConfig(), is_hybrid_swa=mc.is_hybrid_swa, is_hybrid_swa_compress=False,
        use_mla_backend=False, layer_info=info, forward_stream=None, req_to_token_pool=None,
        token_to_kv_pool_allocator=None, memory_pool_config=None)
    rest = req["rest_gb"]
    per_req = None
    try:
        if kvc.mambaish_config is not None:
            per_req = kvc.mambaish_config.mamba2_cache_params.mamba_cache_per_req
            rest = kvc._handle_max_mamba_cache(rest)
        cfg = kvc.config_from_budget(int(rest * (1 << 30)))
        mrr = kvc.resolve_max_num_reqs(cfg.max_total_num_tokens)
    except (ValueError, RuntimeError) as err:
        return {"error": str(err)}
    return {"full": cfg.max_total_num_tokens, "swa": cfg.swa_max_total_num_tokens, "mrr": mrr,
            "slots": get_schedule().max_mamba_cache_size if per_req is not None else None,
            "mamba_cache_per_req": per_req, "window": window, "is_hybrid_swa": mc.is_hybrid_swa,
            "swa_ids": mc.swa_attention_layer_ids, "full_ids": mc.full_attention_layer_ids,
            "context_len": mc.context_len}


def main() -> int:
    reqs = json.load(sys.stdin)
    json.dump([answer(r) for r in reqs], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
