"""Run inside the vLLM 0.33.0 environment: what vLLM's own code says about a hybrid model's layers.

`python vllm_hybrid_facts.py < request.json` prints JSON. For each `models[]` entry (a folder with
config.json) it reports the config as vLLM reads it (`vllm.transformers_utils.config.get_config`,
the transformers config class filling in defaults). It also reports the FlashAttention backend's
kernel block sizes, the block a window layer picks (`_largest_kernel_block_within`), and for each
`gdn[]` entry the Gated DeltaNet state (vLLM's `MambaStateShapeCalculator` /
`MambaStateDtypeCalculator`) and the block size `Platform._align_hybrid_block_size` settles on.

The model classes need not be importable here (with main's pin list gpt-oss and Qwen3-Next lack
`compressed_tensors`, Gemma 3 and Llama 4 `torchvision`: "Model architectures [...] failed to be
inspected"), so `_align_hybrid_block_size` runs with the registry answering a stand-in class whose
two methods are Qwen3NextForCausalLM's (models/qwen3_next.py L881-912) and with stand-in layers
registering the attention backend and the GDN layers' prefill checkpoint alignment (what the real
layers register in `static_forward_context`; the layers need a built model).
"""

from __future__ import annotations

import json
import os
import sys
import types

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within  # noqa: E402
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: E402
from vllm.model_executor.layers.mamba.abstract import MambaBase  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.platforms.interface import Platform  # noqa: E402
from vllm.transformers_utils.config import get_config, get_hf_text_config  # noqa: E402
from vllm.v1.attention.backend import MultipleOf  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: E402

_KEYS = ("layer_types", "sliding_window", "attention_chunk_size", "no_rope_layers", "model_type",
         "num_hidden_layers", "num_key_value_heads", "head_dim", "linear_num_key_heads",
         "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
         "linear_conv_kernel_dim")


def config_facts(folder: str) -> dict:
    hf = get_config(folder, trust_remote_code=False)
    text = get_hf_text_config(hf)
    return {k: getattr(text, k, None) for k in _KEYS} | {"architectures": hf.architectures}


class _Attn(AttentionLayerBase):
    def get_attn_backend(self):
        return FlashAttentionBackend

    def get_kv_cache_spec(self, vllm_config):
        return None


class _GDN(MambaBase):
    def __init__(self, alignment):
        super().__init__()
        self._alignment = alignment

    def get_state_shape(self):
        return ()

    def get_state_dtype(self):
        return ()

    @property
    def mamba_type(self):
        return None

    def get_attn_backend(self):  # an SSM backend: skipped when picking attention block sizes
        return types.SimpleNamespace(is_ssm=lambda: True)

    def get_prefill_checkpoint_alignment(self):
        return self._alignment


def gdn_facts(req: dict) -> dict:
    text = types.SimpleNamespace(**{k: req[k] for k in _KEYS if k.startswith("linear_")})
    tp = req["tp"]
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
        text.linear_value_head_dim, text.linear_conv_kernel_dim, 0)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        torch.bfloat16, req["mamba_cache_dtype"], req["mamba_ssm_cache_dtype"])

    class Stand:  # Qwen3NextForCausalLM's two classmethods, with this config
        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config):
            return shapes

        @classmethod
        def get_mamba_state_dtype_from_config(cls, vllm_config):
            return dtypes

    from vllm.model_executor.models import ModelRegistry
    ModelRegistry.resolve_model_cls = lambda *a, **k: (Stand, "Qwen3NextForCausalLM")
    vc = VllmConfig()
    vc.model_config = types.SimpleNamespace(
        use_mla=False, dtype=torch.bfloat16, architecture="Qwen3NextForCausalLM",
        get_num_kv_heads=lambda pc: max(1, req["num_key_value_heads"] // tp),
        get_head_size=lambda: req["head_dim"])
    cc = vc.cache_config
    cc.block_size = req["block_size"]
    cc.cache_dtype = "auto"
    cc.mamba_cache_mode = req["mamba_cache_mode"]
    ctx = vc.compilation_config.static_forward_context
    ctx.clear()
    ctx["model.layers.3.self_attn.attn"] = _Attn()
    ctx["model.layers.0.linear_attn"] = _GDN(req["checkpoint_alignment"])
    Platform._align_hybrid_block_size.__func__(Platform, vc, FlashAttentionBackend)
    return {"shapes": [list(s) for s in shapes], "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "block_size": cc.block_size, "mamba_block_size": cc.mamba_block_size,
            "mamba_page_size_padded": cc.mamba_page_size_padded}


def gdn_backend_facts(req: dict) -> dict:
    """The GDN prefill kernel `_resolve_gdn_prefill_backend` picks on a CUDA GPU of compute capability
    `req["capability"]` (a stand-in platform: vLLM's own capability tests, the wheel's CUDA 13 runtime), for
    `linear_key_head_dim` and `--gdn-prefill-backend` (additional_config, engine/arg_utils.py L2865-2866):
    {"backend": ...}, or {"error": ...} where vLLM refuses the request."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    from vllm.platforms.interface import DeviceCapability, PlatformEnum

    class Cuda(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"

        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(*req["capability"])

        @classmethod
        def get_cuda_runtime_major(cls):
            return 13

    gdn.current_platform = Cuda()
    extra = {} if req["requested"] is None else {"gdn_prefill_backend": req["requested"]}
    vc = types.SimpleNamespace(additional_config=extra, model_config=types.SimpleNamespace(
        hf_text_config=types.SimpleNamespace(linear_key_head_dim=req["head_k_dim"],
                                             linear_value_head_dim=req["head_k_dim"])))
    try:
        return {"backend": gdn._resolve_gdn_prefill_backend(vc)[1]}
    except (RuntimeError, ValueError) as e:
        return {"error": str(e)}


def backend_facts() -> dict:
    sizes = FlashAttentionBackend.get_supported_kernel_block_sizes()
    # a window layer with 8 KV heads of 64, bf16 (gpt-oss), primary block 16 (attention.py L641-663)
    spec = SlidingWindowSpec(block_size=1, num_kv_heads=8, head_size=64, dtype=torch.bfloat16,
                             sliding_window=128)
    per_token = spec.real_page_size_bytes
    return {"flash_attn_block_sizes": [f"MultipleOf({s.base})" if isinstance(s, MultipleOf) else s
                                       for s in sizes],
            "sliding_block_for_16": _largest_kernel_block_within(
                FlashAttentionBackend, per_token, per_token * 16, 16, spec)}


def engine_facts(folder: str) -> dict:
    """`vllm serve`'s own config resolution (EngineArgs.create_engine_config) for a folder: the
    model-level window (engine/arg_utils.py L2288-2294) and the hybrid manager decision
    (config/vllm.py L2223-2294) under this process's VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE."""
    from vllm.engine.arg_utils import EngineArgs
    vc = EngineArgs(model=folder, skip_tokenizer_init=True, max_model_len=8192).create_engine_config()
    return {"cache_sliding_window": vc.cache_config.sliding_window,
            "hybrid_kv_cache_manager": not vc.scheduler_config.disable_hybrid_kv_cache_manager,
            "attention_chunk_size": vc.model_config.attention_chunk_size}


def main() -> int:
    req = json.load(sys.stdin)
    if "engines" in req:  # each folder under its own environment variables, in order, in this process
        answers = []
        for case in req["engines"]:
            os.environ.update(case["env"])  # vllm.envs reads them when the config asks, not at import
            answers.append(engine_facts(case["folder"]))
        json.dump(answers, sys.stdout)
        return 0
    out = {"configs": {m: config_facts(m) for m in req.get("models", [])},
           "backend": backend_facts(),
           "gdn": [gdn_facts(g) for g in req.get("gdn", [])],
           "gdn_backends": [gdn_backend_facts(g) for g in req.get("gdn_backends", [])]}
    json.dump(out, sys.stdout, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
