"""The size arithmetic every part of the theory shares: bytes per element of a dtype (as the
engines' configs and torch name them), the binary units the engines' memory formulas use, and the
ceiling division that turns tokens into blocks or pages."""

from __future__ import annotations

GIB = 2**30
MIB = 2**20

# Element sizes under every spelling a config.json, a CLI flag or torch uses for them.
DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "float8_e4m3fn": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e5m2": 1,
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division (vLLM's `utils.math_utils.cdiv`): the blocks `a` tokens fill at `b` per block."""
    return -(-a // b)


def format_gib(nbytes: float) -> str:
    """vLLM's `format_gib` (vllm/utils/mem_utils.py): GiB rounded to two places, as its messages print them."""
    return str(round(nbytes / GIB, 2))
