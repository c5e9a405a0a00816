"""Quantised linear layers as vLLM allocates them, from a checkpoint's `quantization_config`.

One `LinearQuant` per checkpoint gives the bytes of a quantised linear weight of `out x in` elements:
the packed weight plus its scales and zero points, in the layout the engine's `create_weights`
registers (read in vLLM 0.33.0, `model_executor/layers/quantization/`):

* ``fp8`` (`fp8.py` Fp8LinearMethod): one byte per weight; a block-quantised checkpoint adds an fp32
  scale per ``weight_block_size`` block, a per-tensor one a single fp32 scale (negligible, not counted).
* ``gptq`` / ``gptq_marlin`` / ``auto_gptq`` (`auto_gptq.py` AutoGPTQLinearMethod.create_weights):
  ``qweight`` int32 ``[in / pack, out]``, ``scales`` ``[in / group, out]`` in the model dtype,
  ``qzeros`` int32 ``[in / group, out / pack]`` (pack = 32 / bits). The Marlin kernel repacks qweight
  and permutes scales in place (`kernels/linear/mixed_precision/marlin.py` process_weights_after_loading):
  the same bytes; its workspace is one small buffer per device, not counted.
* ``awq`` / ``awq_marlin`` (`auto_awq.py` AutoAWQLinearMethod.create_weights): ``qweight`` int32
  ``[in, out / pack]``, ``qzeros`` int32 ``[in / group, out / pack]``, ``scales`` ``[in / group, out]``.
* ``compressed-tensors`` (`compressed_tensors/schemes/`): the first config group's ``weights`` say the
  scheme. 4/8-bit integers with groups or channels (``pack-quantized``, W4A16/W8A16,
  compressed_tensors_wNa16.py): ``weight_packed`` int32 ``[out, in x bits / 32]``, ``weight_scale``
  ``[out, in / group]`` in the model dtype (one column per channel), int32 zero points when asymmetric.
  8-bit float or int (``float-quantized`` FP8 dynamic/static, ``int-quantized`` W8A8;
  compressed_tensors_w8a8_fp8.py, compressed_tensors_w8a8_int8.py): one byte per weight and an fp32
  scale per output channel (``strategy: channel``) or per shard (``tensor``, negligible).

Layers named in ``ignore`` (compressed-tensors) or ``modules_to_not_convert`` (AWQ) stay in the model
dtype; kvprobe knows the ones it models apart (lm_head, the MoE router, a vision tower it does not
count) and refuses a list naming decoder linear layers rather than guess which ones. A method not
listed here is an error naming ``quantization_config.quant_method``: bitsandbytes among them, which
vLLM 0.33.0 no longer registers (quantization/__init__.py get_quantization_config has no entry for it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvprobe.errors import ConfigError

_KEY = "quantization_config"
GPTQ_METHODS = ("gptq", "gptq_marlin", "auto_gptq")
AWQ_METHODS = ("awq", "awq_marlin", "auto_awq")
COUNTED_METHODS = ("fp8", "mxfp4", "compressed-tensors", *GPTQ_METHODS, *AWQ_METHODS)
# Ignored modules kvprobe already counts at the model dtype or does not count (the vision tower).
_NOT_LINEAR = re.compile(r"lm_head|vision|visual|multi_modal|projector|image|audio")


def _not_modelled_as_quantised(name: str) -> bool:
    """lm_head, a vision tower, the MoE router (`mlp.gate`, `re:.*mlp.gate$`): kvprobe counts them apart."""
    bare = name.removeprefix("re:").rstrip("$")
    return bool(_NOT_LINEAR.search(bare)) or bare.endswith("gate")


@dataclass(frozen=True)
class LinearQuant:
    """How one quantised linear weight is stored on the GPU."""

    method: str  # the quant_method, and the scheme for compressed-tensors ("compressed-tensors w4a16")
    weight_bits: int
    group: int  # input elements per scale; -1 one scale per output channel; 0 one per tensor
    scale_bytes: int  # bytes of one scale
    zero_points: bool = False  # int32-packed zero points, one per scale
    block: tuple[int, int] | None = None  # fp8 block quantisation (out, in) per fp32 scale
    packed_int32: bool = True  # sub-byte weights packed into int32 words (rounds up per row)

    def nbytes(self, out_f: int, in_f: int) -> int:
        if self.block:
            return out_f * in_f + math.ceil(out_f / self.block[0]) * math.ceil(in_f / self.block[1]) * 4
        if self.weight_bits >= 8:
            weight = out_f * in_f * self.weight_bits // 8
        else:  # int32 words along one dimension: ceil(in x bits / 32) per output row
            weight = out_f * math.ceil(in_f * self.weight_bits / 32) * 4
        if self.group == 0:
            return weight
        groups = 1 if self.group == -1 else math.ceil(in_f / self.group)
        scales = out_f * groups * self.scale_bytes
        zeros = math.ceil(out_f * self.weight_bits / 32) * 4 * groups if self.zero_points else 0
        return weight + scales + zeros

    @property
    def fp8(self) -> bool:
        return self.weight_bits == 8 and self.method in ("fp8", "compressed-tensors fp8")


def _int(q: dict, key: str, source: str, *, default: int | None = None) -> int:
    value = q.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"expected an integer, got {value!r}", file=source, key=f"{_KEY}.{key}")
    return value


def _check_ignored(names, source: str, key: str) -> None:
    for name in names or ():
        if not _not_modelled_as_quantised(str(name)):
            raise ConfigError(f"{name!r} is left unquantised; kvprobe counts a checkpoint that leaves out only "
                              "lm_head, the MoE router or a vision tower (which decoder layers a pattern names is "
                              "not modelled)", file=source, key=f"{_KEY}.{key}")


def _gptq_awq(method: str, q: dict, dtype_bytes: int, source: str) -> LinearQuant:
    bits = _int(q, "bits", source, default=q.get("w_bit", 4))
    group = _int(q, "group_size", source, default=q.get("q_group_size", 128))
    if bits not in (2, 3, 4, 8) or group == 0 or group < -1:
        raise ConfigError(f"expected bits in 2/3/4/8 and group_size -1 or > 0, got bits {bits}, group_size {group}",
                          file=source, key=f"{_KEY}.bits")
    _check_ignored(q.get("modules_to_not_convert"), source, "modules_to_not_convert")
    return LinearQuant(method, bits, group, dtype_bytes, zero_points=True)


def _compressed_tensors(q: dict, dtype_bytes: int, source: str) -> LinearQuant:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("expected config_groups with one scheme", file=source, key=f"{_KEY}.config_groups")
    schemes = {str((g or {}).get("weights")) for g in groups.values()}
    if len(schemes) > 1:
        raise ConfigError(f"expected one weight scheme for all linear layers, got {len(schemes)} config groups "
                          "with different ones", file=source, key=f"{_KEY}.config_groups")
    w = next(iter(groups.values())).get("weights")
    if not isinstance(w, dict):
        raise ConfigError("expected a weights scheme", file=source, key=f"{_KEY}.config_groups.*.weights")
    bits, kind = _int(w, "num_bits", source), str(w.get("type", "int"))
    strategy = str(w.get("strategy", "tensor"))
    _check_ignored(q.get("ignore"), source, "ignore")
    if kind == "float" and bits == 8:
        if strategy == "block":
            return LinearQuant("compressed-tensors fp8", 8, 0, 4, block=tuple(w.get("block_structure") or (128, 128)))
        return LinearQuant("compressed-tensors fp8", 8, -1 if strategy == "channel" else 0, 4)
    if kind == "int" and bits == 8 and not w.get("group_size") and strategy in ("channel", "tensor") \
            and (q.get("format") != "pack-quantized"):
        return LinearQuant("compressed-tensors int8", 8, -1 if strategy == "channel" else 0, 4)
    if kind == "int" and bits in (4, 8) and strategy in ("group", "channel"):
        group = _int(w, "group_size", source) if strategy == "group" else -1
        return LinearQuant(f"compressed-tensors w{bits}a16", bits, group, dtype_bytes,
                           zero_points=not w.get("symmetric", True))
    raise ConfigError(f"expected a compressed-tensors scheme kvprobe counts (8-bit float, 8-bit int, 4/8-bit int "
                      f"groups or channels), got {bits}-bit {kind} by {strategy}", file=source,
                      key=f"{_KEY}.config_groups.*.weights")


def linear_quant(cfg: dict, dtype_bytes: int, source: str) -> LinearQuant | None:
    """The checkpoint's linear-layer quantisation, None for a 16-bit (or MXFP4, experts only) one."""
    q = cfg.get(_KEY)
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower() if isinstance(q, dict) else ""
    if method not in COUNTED_METHODS:
        raise ConfigError(f"expected a quantisation kvprobe counts ({', '.join(COUNTED_METHODS)}), got "
                          f"{method or q!r} (counting its weights at the model dtype would misstate the pool)",
                          file=source, key=f"{_KEY}.quant_method")
    if method == "mxfp4":
        return None
    if method == "fp8":
        block = q.get("weight_block_size")
        return LinearQuant("fp8", 8, 0, 4, block=tuple(block) if block else None)
    if method in GPTQ_METHODS or method in AWQ_METHODS:
        return _gptq_awq(method, q, dtype_bytes, source)
    return _compressed_tensors(q, dtype_bytes, source)
