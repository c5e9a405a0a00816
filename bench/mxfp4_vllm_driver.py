"""Runs in vLLM 0.33.0's environment: the MXFP4 expert buffers vLLM's own GptOssMxfp4MoEMethod
creates for gpt-oss (quantization/mxfp4.py create_weights L200-292) after its own backend round-up
(fused_moe/oracle/mxfp4.py mxfp4_round_up_hidden_size_and_intermediate_size), on the meta device
(shapes and dtypes, no memory). argv[1]: JSON [{"arch", "experts", "hidden", "inter", "tp"}];
prints {"dims": [H, I], "bytes": {param: nbytes}} per case as one JSON list.

TRITON is the backend vLLM picks on Hopper, FLASHINFER_TRTLLM_MXFP4_BF16 on Blackwell (SM100); the
selection itself needs the GPU and is not run here (kvprobe/theory/model/mxfp4.py cites it)."""

import json
import sys
import types

import torch
from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
    Mxfp4MoeBackend,
    mxfp4_round_up_hidden_size_and_intermediate_size,
)
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

BACKEND = {"sm90": Mxfp4MoeBackend.TRITON, "sm100": Mxfp4MoeBackend.FLASHINFER_TRTLLM_MXFP4_BF16}

out = []
for case in json.loads(sys.argv[1]):
    h, i = mxfp4_round_up_hidden_size_and_intermediate_size(BACKEND[case["arch"]], case["hidden"],
                                                            case["inter"] // case["tp"])
    method = GptOssMxfp4MoEMethod.__new__(GptOssMxfp4MoEMethod)  # __init__ selects a backend: needs a GPU
    method.moe = types.SimpleNamespace(w13_num_shards=2, has_bias=True)  # gpt_oss.py L399 has_bias=True
    layer = torch.nn.Module()
    with torch.device("meta"):
        method.create_weights(layer, num_experts=case["experts"], hidden_size=h, intermediate_size_per_partition=i,
                              params_dtype=torch.bfloat16)
    out.append({"dims": [h, i], "bytes": {n: p.numel() * p.element_size() for n, p in layer.named_parameters()}})
print(json.dumps(out))
