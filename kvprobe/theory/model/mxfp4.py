"""MXFP4 MoE experts (gpt-oss, `quant_method: mxfp4`): their bytes in the checkpoint and as each
engine allocates them on a GPU.

The checkpoint stores each expert weight as 4-bit E2M1 values packed two per uint8 plus one uint8
E8M0 scale per 32 values, and a bf16 bias per output row; everything outside the experts is bf16.
Both engines keep that layout on the GPU (vLLM 0.33.0 `layers/quantization/mxfp4.py`
GptOssMxfp4MoEMethod.create_weights L200-292; SGLang 0.5.23 `layers/quantization/mxfp4.py`
Mxfp4MoEMethod.create_weights L444-630: w13 [E, 2I, H/2] + scale [E, 2I, H/32] + bias [E, 2I] bf16,
w2 [E, H, I/2] + scale [E, H, I/32] + bias [E, H] bf16, I the intermediate size per TP rank), but
round H and I up to what the MoE kernel they pick needs. The kernel depends on the GPU:

* Hopper (sm90): vLLM picks TRITON (the OAI triton_kernels vLLM bundles; FLASHINFER_TRTLLM_* need
  SM100, `fused_moe/experts/trtllm_mxfp4_moe.py` L121-123; priority list `fused_moe/oracle/mxfp4.py`
  L402-435), whose round-up is the fall-through `I -> 64` (oracle/mxfp4.py L915-916). SGLang's gpt-oss
  override picks `triton_kernel` (`arg_groups/model_overrides/gpt_oss.py` L102-120), whose round-up is
  `I -> 64` (mxfp4.py L548-551). That needs the `triton_kernels` package, which SGLang 0.5.23 does
  not require: without it I stays I/tp (the same at TP 1; at TP 4, 720 instead of 768).
* Blackwell (sm100): vLLM picks FLASHINFER_TRTLLM_MXFP4_BF16 (first in the list): `I -> 128,
  H -> 256` (oracle/mxfp4.py L871-873). SGLang picks `flashinfer_mxfp4` (gpt_oss.py L65-69): FusedMoE
  rounds H to 256 (`layers/moe/fused_moe_triton/layer.py` L452-457), create_weights I to 128 and H to
  128 (mxfp4.py L478-488), so H 2880 -> 3072 and I 2880 -> 2944 in both engines.
* Ada (sm89: L4, L40S, RTX 4090), vLLM only: the kernels before it in gpt-oss's priority list (0.29.0
  oracle/mxfp4.py L321-340: TRTLLM, AITER, TRITON, FLASHINFER_CUTLASS) do not run there, so vLLM picks MARLIN
  (0.29.0's log on an L4: `Using 'MARLIN' Mxfp4 MoE backend.`), whose round-up is `I -> 128, H -> 256`
  (0.29.0 `fused_moe/oracle/mxfp4.py` mxfp4_round_up_hidden_size_and_intermediate_size L734-739): the
  same 3072 / 2944 as Blackwell, 0.86 GiB more than Hopper for gpt-oss-20b. SGLang on sm89 is not read.

What this leaves out, on purpose: the triton path's post-load swizzle (it replaces the buffers with
kernel-layout copies; vLLM `_setup_kernel`, mxfp4.py L294-390) and the weight-load staging copies.
`bench/bench_mxfp4_engines.py` runs both engines' create_weights (meta device) against this module.
"""

from __future__ import annotations

from kvprobe.errors import ConfigError
from kvprobe.theory.model.sizes import cdiv

MXFP4_BLOCK = 32  # values per E8M0 scale byte (both engines: `mxfp4_block = 32`)
BIAS_BYTES = 2  # expert biases are bf16 in the checkpoint and in both engines' buffers
GPU_ARCHS = ("sm89", "sm90", "sm100")
DEFAULT_GPU_ARCH = "sm90"  # Hopper, as budget.py assumes for MLA's block size

# (hidden alignment, intermediate-per-rank alignment) of the expert buffers: see the module doc.
_ALIGN = {
    ("vllm", "sm90"): (1, 64),
    ("vllm", "sm100"): (256, 128),
    ("vllm", "sm89"): (256, 128),  # MARLIN (module doc)
    ("sglang", "sm90"): (1, 64),
    ("sglang", "sm100"): (256, 128),
}
# Attention sinks (gpt-oss: one per attention head per layer): vLLM makes them in the model dtype
# (`model_loader/weight_utils.py` make_attention_sink L1584-1592, dtype None); SGLang in float32 with
# its SM100 default attention backend trtllm_mha, else bfloat16 (`models/gpt_oss.py` L425-431).
_SINK_BYTES = {("sglang", "sm100"): 4}


def _round_up(x: int, align: int) -> int:
    return cdiv(x, align) * align


def _check_arch(gpu_arch: str) -> None:
    if gpu_arch not in GPU_ARCHS:
        raise ConfigError(f"expected one of {', '.join(GPU_ARCHS)}, got {gpu_arch!r}", key="gpu_arch")


def expert_tensor_bytes(kind: str, experts: int, hidden: int, inter: int, *, bias: bool = True) -> int:
    """Bytes of w13 (gate_up: [E, 2I, H]) or w2 (down: [E, H, I]) in MXFP4 with their scales and
    bf16 biases, for the given (already padded, per-rank) H and I."""
    if kind == "w13":
        rows, cols = 2 * inter, hidden
    elif kind == "w2":
        rows, cols = hidden, inter
    else:
        raise ValueError(f"expert tensor kind {kind!r}")
    if cols % MXFP4_BLOCK:  # the checkpoint's shapes are whole blocks; a config saying otherwise is wrong
        raise ConfigError(f"MXFP4 needs a multiple of {MXFP4_BLOCK}, got {cols}",
                          key="hidden_size" if kind == "w13" else "intermediate_size")
    per_row = cols // 2 + cols // MXFP4_BLOCK + (BIAS_BYTES if bias else 0)
    return experts * rows * per_row


def engine_expert_dims(engine: str, gpu_arch: str, hidden: int, inter: int, tp: int) -> tuple[int, int]:
    """(H, I per rank) of the buffers `engine` allocates on `gpu_arch` (module doc)."""
    _check_arch(gpu_arch)
    if (engine, gpu_arch) not in _ALIGN:
        raise ConfigError(f"{engine}'s MXFP4 expert layout on {gpu_arch} is not read; expected one of "
                          f"{', '.join(a for e, a in _ALIGN if e == engine)}", key="gpu_arch")
    h_align, i_align = _ALIGN[(engine, gpu_arch)]
    return _round_up(hidden, h_align), _round_up(inter // tp, i_align)


def engine_expert_bytes(kind: str, experts: int, hidden: int, inter: int, *, engine: str,
                        gpu_arch: str = DEFAULT_GPU_ARCH, tp: int = 1, bias: bool = True) -> int:
    """Bytes one TP rank allocates for w13 or w2 of all `experts` (no expert parallelism)."""
    h, i = engine_expert_dims(engine, gpu_arch, hidden, inter, tp)
    return expert_tensor_bytes(kind, experts, h, i, bias=bias)


def sink_bytes(engine: str | None, gpu_arch: str, model_dtype_bytes: int) -> int:
    """Bytes of one attention sink value as `engine` holds it (the checkpoint's when engine is None)."""
    if engine is None:
        return model_dtype_bytes
    _check_arch(gpu_arch)
    return _SINK_BYTES.get((engine, gpu_arch), model_dtype_bytes)
