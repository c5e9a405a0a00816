"""Layer kinds of a decoder, read from config.json the way the engines read it.

A hybrid model keeps different state per layer: a *full* attention layer holds K and V for every
token of the request; a *sliding* layer attends to the last `sliding_window` tokens only, so the
engine may drop what falls out of the window; a *chunked* layer (Llama 4's local attention)
attends within aligned chunks of `attention_chunk_size` tokens; a *linear* layer (Qwen3-Next's
Gated DeltaNet) keeps a fixed recurrent state per request whatever its length.

Both engines read config.json through transformers' config classes, which fill in keys a
checkpoint leaves out (transformers 5.20, the version pinned in the vLLM 0.33.0 environment):

* `layer_types` wins when present; otherwise each config class derives it —
  Gemma 3 from `sliding_window_pattern` (default 6: every 6th layer full,
  gemma3/configuration_gemma3.py L106-112), Qwen3-Next from `full_attention_interval` (default
  4, qwen3_next/configuration_qwen3_next.py L130-135), gpt-oss alternating from a sliding layer 0
  (gpt_oss/configuration_gpt_oss.py L83-86), Llama 4 from `no_rope_layers`.
* Llama 4: `no_rope_layers[i] == 0` marks a NoPE layer with global (full) attention; an empty or
  missing list becomes one NoPE layer every `no_rope_layer_interval` (default 4) layers
  (llama4/configuration_llama4.py L180-183). vLLM builds `ChunkedLocalAttention` on every RoPE
  layer when `attention_chunk_size` is set (models/llama4.py L184-185, L251-252).
* gpt-oss: vLLM ignores `layer_types` and puts the window on even layers (models/gpt_oss.py
  L175); a config whose `layer_types` says otherwise is refused, since the engines would disagree.
* Mistral: `MistralConfig` has no `layer_types` and defaults `sliding_window` to 4096 when the key
  is absent (mistral/configuration_mistral.py L80); vLLM then windows every layer through
  `CacheConfig.sliding_window` (engine/arg_utils.py L2288-2294). A `sliding_window` of 0 means
  none (config/model.py L815-821).
* Qwen2/Qwen3: `sliding_window` counts only with `use_sliding_window` (qwen2/configuration_qwen2.py
  L84); with it, only layers >= `max_window_layers` slide — not modelled, refused.

A config with a layer kind kvprobe does not model is a ConfigError naming the key; nothing is
silently taken for full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprobe.errors import ConfigError

FULL, SLIDING, CHUNKED, LINEAR = "full", "sliding", "chunked", "linear"
KINDS = (FULL, SLIDING, CHUNKED, LINEAR)
# Kinds that keep K/V per token (bounded or not); LINEAR keeps a per-request state instead.
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)

# layer_types entries as transformers writes them -> kvprobe's kind
_LAYER_TYPE_NAMES = {
    "full_attention": FULL, "attention": FULL, "sliding_attention": SLIDING,
    "chunked_attention": CHUNKED, "linear_attention": LINEAR,
}
# Model types whose non-full layers kvprobe models (and the key that describes them).
_MODELLED = {"gpt_oss", "gemma3", "gemma3_text", "llama4", "llama4_text", "qwen3_next", "mistral"}
# Keys that describe layer kinds kvprobe does not model (Mamba/SSM, lightning attention, custom
# local-layer lists...). Any of them present -> refuse, naming the key.
_UNMODELLED_KEYS = (
    "layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "attn_type_list",
    "hybrid_layer_pattern", "local_layer_ids", "interleaved_sliding_window", "mamba_d_state",
    "ssm_cfg", "kv_sharing_layer_map", "num_kv_shared_layers",
)
_GDN_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim", "linear_conv_kernel_dim")
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096  # transformers MistralConfig.sliding_window default
GEMMA3_DEFAULT_PATTERN = 6  # transformers Gemma3TextConfig: sliding_window_pattern default
QWEN3_NEXT_DEFAULT_INTERVAL = 4  # transformers Qwen3NextConfig: full_attention_interval default
LLAMA4_DEFAULT_NOPE_INTERVAL = 4  # transformers Llama4TextConfig.no_rope_layer_interval
LLAMA4_DEFAULT_CHUNK = 8192  # transformers Llama4TextConfig.attention_chunk_size default


@dataclass(frozen=True)
class GatedDeltaNet:
    """Shapes of a Gated DeltaNet (linear attention) layer's recurrent state, unsharded."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution over [q, k, v] (mamba_utils.py L282 in vLLM 0.33)."""
        return self.head_k_dim * self.num_k_heads * 2 + self.head_v_dim * self.num_v_heads


@dataclass(frozen=True)
class LayerKinds:
    """One kind per decoder layer, plus the parameters those kinds need."""

    kinds: tuple[str, ...]
    sliding_window: int | None = None  # tokens a sliding layer attends to (the config's value)
    attention_chunk_size: int | None = None
    linear: GatedDeltaNet | None = None
    key: str = ""  # the config key the kinds were read from, for messages and reports

    def ids(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == kind)

    def count(self, kind: str) -> int:
        return sum(1 for k in self.kinds if k == kind)

    @property
    def hybrid(self) -> bool:
        """Anything other than full attention on every layer (an all-sliding model included)."""
        return any(k != FULL for k in self.kinds)

    @property
    def attention_layers(self) -> int:
        """Layers that keep K/V per token (full, sliding or chunked)."""
        return sum(1 for k in self.kinds if k in ATTENTION_KINDS)

    def describe(self) -> str:
        parts = [f"{self.count(k)} {k}" for k in KINDS if self.count(k)]
        extra = []
        if self.sliding_window and self.count(SLIDING):
            extra.append(f"window {self.sliding_window}")
        if self.attention_chunk_size and self.count(CHUNKED):
            extra.append(f"chunk {self.attention_chunk_size}")
        return ", ".join(parts) + (f" ({', '.join(extra)})" if extra else "")


def all_full(num_layers: int) -> LayerKinds:
    return LayerKinds((FULL,) * num_layers)


def _positive(cfg: dict, key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"expected a positive integer, got {value!r}", file=source, key=key)
    return value


def _from_layer_types(cfg: dict, n: int, source: str) -> tuple[str, ...]:
    types = cfg["layer_types"]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"expected a list of {n} layer kinds (one per layer), got "
                          f"{len(types) if isinstance(types, list) else type(types).__name__}",
                          file=source, key="layer_types")
    unknown = sorted({t for t in types if t not in _LAYER_TYPE_NAMES}, key=str)
    if unknown:
        raise ConfigError(f"layer kind(s) {unknown} are not modelled by kvprobe (known: "
                          f"{', '.join(_LAYER_TYPE_NAMES)})", file=source, key="layer_types")
    return tuple(_LAYER_TYPE_NAMES[t] for t in types)


def _pattern(n: int, every: int, *, hit: str, other: str) -> tuple[str, ...]:
    """Layer i is `hit` when (i + 1) is a multiple of `every`, else `other`."""
    return tuple(hit if (i + 1) % every == 0 else other for i in range(n))


def _gemma3(cfg: dict, n: int, source: str) -> LayerKinds:
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional (embedding) Gemma 3 is not a generative decoder; its "
                          "window is rewritten by transformers and is not modelled",
                          file=source, key="use_bidirectional_attention")
    if "layer_types" in cfg and cfg["layer_types"] is not None:
        kinds, key = _from_layer_types(cfg, n, source), "layer_types"
    else:
        every = _positive(cfg, "sliding_window_pattern", source, GEMMA3_DEFAULT_PATTERN)
        kinds, key = _pattern(n, every, hit=FULL, other=SLIDING), "sliding_window_pattern"
    window = _positive(cfg, "sliding_window", source) if SLIDING in kinds else None
    return LayerKinds(kinds, sliding_window=window, key=key)


def _gpt_oss(cfg: dict, n: int, source: str) -> LayerKinds:
    vllm_rule = tuple(SLIDING if i % 2 == 0 else FULL for i in range(n))  # models/gpt_oss.py L175
    if cfg.get("layer_types") is not None:
        kinds = _from_layer_types(cfg, n, source)
        if kinds != vllm_rule:
            raise ConfigError("vLLM 0.33 windows the even layers of gpt_oss whatever layer_types "
                              "says (models/gpt_oss.py L175); this config's layer_types differ, so "
                              "the engines would not agree", file=source, key="layer_types")
    return LayerKinds(vllm_rule, sliding_window=_positive(cfg, "sliding_window", source),
                      key="layer_types")


def _llama4(cfg: dict, n: int, source: str) -> LayerKinds:
    nope = cfg.get("no_rope_layers") or []
    if nope:
        if not isinstance(nope, list) or len(nope) != n:
            raise ConfigError(f"expected a list of {n} 0/1 flags (0 = NoPE, global attention)",
                              file=source, key="no_rope_layers")
        rope = tuple(bool(x) for x in nope)
    else:
        every = _positive(cfg, "no_rope_layer_interval", source, LLAMA4_DEFAULT_NOPE_INTERVAL)
        rope = tuple((i + 1) % every != 0 for i in range(n))
    chunk = cfg.get("attention_chunk_size", LLAMA4_DEFAULT_CHUNK)
    if chunk is None:  # no chunked attention: every layer global
        return LayerKinds((FULL,) * n, key="attention_chunk_size")
    chunk = _positive(cfg, "attention_chunk_size", source, LLAMA4_DEFAULT_CHUNK)
    kinds = tuple(CHUNKED if r else FULL for r in rope)
    return LayerKinds(kinds, attention_chunk_size=chunk, key="no_rope_layers")


def _qwen3_next(cfg: dict, n: int, source: str) -> LayerKinds:
    if cfg.get("layer_types") is not None:
        kinds, key = _from_layer_types(cfg, n, source), "layer_types"
    else:
        every = _positive(cfg, "full_attention_interval", source, QWEN3_NEXT_DEFAULT_INTERVAL)
        kinds, key = _pattern(n, every, hit=FULL, other=LINEAR), "full_attention_interval"
    gdn = GatedDeltaNet(*(_positive(cfg, k, source) for k in _GDN_KEYS))
    if SLIDING in kinds or CHUNKED in kinds:
        raise ConfigError("Qwen3-Next layers are linear or full attention only",
                          file=source, key=key)
    return LayerKinds(kinds, linear=gdn, key=key)


def _generic(cfg: dict, n: int, model_type: str, source: str) -> LayerKinds:
    """Models without a modelled layer pattern: all full, or all sliding (Mistral)."""
    if cfg.get("layer_types") is not None:
        kinds = _from_layer_types(cfg, n, source)
        if any(k != FULL for k in kinds):
            raise ConfigError(f"non-full layers in a {model_type or 'this'} model are not modelled "
                              f"by kvprobe (it models {', '.join(sorted(_MODELLED))})",
                              file=source, key="layer_types")
    default = MISTRAL_DEFAULT_SLIDING_WINDOW if model_type == "mistral" else None
    window = cfg.get("sliding_window", default)
    if cfg.get("use_sliding_window") is False or not window:
        return all_full(n)
    if cfg.get("use_sliding_window") is True:
        raise ConfigError("use_sliding_window slides only the layers from max_window_layers on; "
                          "not modelled by kvprobe", file=source, key="use_sliding_window")
    if model_type != "mistral" or cfg.get("layer_types") is not None:
        raise ConfigError(f"which layers of a {model_type or 'this'} model use the window is not "
                          "modelled by kvprobe", file=source, key="sliding_window")
    window = _positive(cfg, "sliding_window", source, default)
    return LayerKinds((SLIDING,) * n, sliding_window=window, key="sliding_window")


def layer_kinds(cfg: dict, num_layers: int, *, source: str = "config.json") -> LayerKinds:
    """The kind of every decoder layer of the text config `cfg` (already unwrapped from
    `text_config`), or a ConfigError naming the key kvprobe cannot model."""
    model_type = str(cfg.get("model_type", ""))
    for key in _UNMODELLED_KEYS:
        if cfg.get(key) not in (None, [], {}):
            raise ConfigError("describes layer kinds kvprobe does not model (only full, "
                              "sliding-window, chunked-local and Gated DeltaNet layers are)",
                              file=source, key=key)
    if model_type != "qwen3_next" and any(cfg.get(k) for k in _GDN_KEYS):
        key = next(k for k in _GDN_KEYS if cfg.get(k))
        raise ConfigError(f"linear-attention layers of model_type {model_type!r} are not modelled "
                          "(kvprobe models Qwen3-Next's Gated DeltaNet)", file=source, key=key)
    if model_type in ("gemma3", "gemma3_text"):
        return _gemma3(cfg, num_layers, source)
    if cfg.get("sliding_window_pattern") is not None:
        raise ConfigError(f"a window pattern for model_type {model_type!r} is not modelled "
                          "(kvprobe models Gemma 3's)", file=source, key="sliding_window_pattern")
    if model_type == "gpt_oss":
        return _gpt_oss(cfg, num_layers, source)
    if model_type in ("llama4", "llama4_text"):
        return _llama4(cfg, num_layers, source)
    if cfg.get("attention_chunk_size") is not None:
        raise ConfigError(f"chunked local attention of model_type {model_type!r} is not modelled "
                          "(kvprobe models Llama 4's)", file=source, key="attention_chunk_size")
    if model_type == "qwen3_next":
        return _qwen3_next(cfg, num_layers, source)
    return _generic(cfg, num_layers, model_type, source)
