"""Runs in SGLang 0.5.23's environment: the MXFP4 expert buffers SGLang's own Mxfp4MoEMethod
creates for gpt-oss (layers/quantization/mxfp4.py create_weights L444-630), on the meta device.
argv[1]: JSON [{"arch", "experts", "hidden", "inter", "tp"}]; prints {param: nbytes} per case.

The GPU and the runner backend are set as SGLang's gpt-oss override sets them on that GPU
(arg_groups/model_overrides/gpt_oss.py L64-120): Hopper -> triton_kernel (which needs the
`triton_kernels` package: marked installed here), Blackwell -> flashinfer_mxfp4, for which FusedMoE
first rounds the hidden size to 256 (layers/moe/fused_moe_triton/layer.py L452-457, done here)."""

import json
import sys
import types

import sglang.srt.layers.quantization.mxfp4 as mx
import torch

out = []
for case in json.loads(sys.argv[1]):
    blackwell = case["arch"] == "sm100"
    mx.get_platform = lambda b=blackwell: types.SimpleNamespace(is_sm100=b, is_sm90=not b, is_sm120=False)
    mx.has_triton_kernels = not blackwell
    method = mx.Mxfp4MoEMethod.__new__(mx.Mxfp4MoEMethod)  # __init__ reads the server's runner backend
    method.use_marlin = method.use_mega_moe = method.use_deep_gemm = False
    method.use_flashinfer, method.use_triton_kernels = blackwell, not blackwell
    method._fi_kernel = "trtllm_sm100" if blackwell else None
    hidden = -(-case["hidden"] // 256) * 256 if blackwell else case["hidden"]
    inter = case["inter"] // case["tp"]
    layer = torch.nn.Module()
    layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_partition = case["experts"], hidden, inter
    with torch.device("meta"):
        method.create_weights(layer, num_experts=case["experts"], hidden_size=hidden,
                              intermediate_size_per_partition=inter, params_dtype=torch.bfloat16, with_bias=True)
    out.append({n: p.numel() * p.element_size() for n, p in layer.named_parameters()})
print(json.dumps(out))
