"""The packaged model presets (config.json files shipped in `kvprobe/theory/model/configs/`) and loading
a model config: a preset id, a config.json path or a directory holding one.

Reading these files and a user's config.json is the only I/O in `kvprobe.theory`.
"""

from __future__ import annotations

import json
import os
from importlib import resources

from kvprobe.errors import ConfigError

# HF id -> packaged file. Values written from the public config.json files on the Hugging Face hub
# (no download at run time); provenance per entry:
PRESETS: dict[str, str] = {
    # meta-llama/Llama-3.1-8B config.json (transformers 4.43); 8,030,261,248 parameters, untied.
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b.json",
    # meta-llama/Llama-3.1-70B config.json; same family, 80 layers, hidden 8192.
    "meta-llama/Llama-3.1-70B": "llama-3.1-70b.json",
    # Qwen/Qwen2.5-7B config.json; q/k/v biases implied by model_type qwen2; 7,615,616,512
    # parameters (= the checkpoint's index total_size 15,231,233,024 B / 2).
    "Qwen/Qwen2.5-7B": "qwen2.5-7b.json",
    # Qwen/Qwen3-8B config.json; q_norm/k_norm per layer; 8,190,735,360 parameters
    # (= index total_size 16,381,470,720 B / 2).
    "Qwen/Qwen3-8B": "qwen3-8b.json",
    # mistralai/Mistral-7B-v0.3 config.json. v0.3, not v0.1: v0.1 declares sliding_window 4096,
    # which makes vLLM plan a sliding-window KV group (different capacity rules: SlidingWindowSpec,
    # vllm/v1/kv_cache_interface.py).
    "mistralai/Mistral-7B-v0.3": "mistral-7b-v0.3.json",
    # deepseek-ai/DeepSeek-V3 config.json: MLA 512+64, 61 layers, 256 routed + 1 shared expert,
    # first 3 layers dense, fp8 block-quantised checkpoint.
    "deepseek-ai/DeepSeek-V3": "deepseek-v3.json",
    # zai-org/GLM-5.3 (glm_moe_dsa) geometry per seed 002 and the published config fields: 78 layers,
    # MLA 512+64, indexer on 21 "full" layers (3 full, then 18 x [3 shared + 1 full], 3 shared),
    # index_head_dim 128, 256 routed experts 8 active, fp8 weights, 1M context as deployed in seed 002.
    "zai-org/GLM-5.3": "glm-5.3.json",
    # --- hybrid attention. The hub is not reachable from this machine; each file is the
    # hub's config.json as published copies of it show, field for field:
    # openai/gpt-oss-20b: a verbatim copy of the hub file (the checkpoint listing whose index
    # total_size is 13,761,264,768 B); 24 layers, layer_types [sliding, full] x 12, window 128,
    # quant_method mxfp4, no torch_dtype (vLLM runs it in bfloat16).
    "openai/gpt-oss-20b": "gpt-oss-20b.json",
    # openai/gpt-oss-120b: the same keys as 20b with 36 layers and 128 experts, as copied from
    # https://huggingface.co/openai/gpt-oss-120b/raw/main/config.json into a public test fixture.
    # Its checkpoint holds 65,248,815,744 B of tensors (index total_size; the model card's 60.8 GiB),
    # 116,829,156,672 parameters de-quantised (keras-hub gpt_oss_presets.py): tests/theory/test_mxfp4.py.
    "openai/gpt-oss-120b": "gpt-oss-120b.json",
    # google/gemma-3-27b-it: Gemma3ForConditionalGeneration; the text_config names only the keys
    # that differ from transformers' defaults (no layer_types, no sliding_window_pattern: the
    # default 6 applies, 52 sliding + 10 full layers, window 1024). Same key set as TensorRT-LLM's
    # GEMMA3_27B_CONFIG test fixture, which copies this file with its layers and window shrunk.
    "google/gemma-3-27b-it": "gemma-3-27b-it.json",
    # meta-llama/Llama-4-Scout-17B-16E-Instruct: Llama4ForConditionalGeneration, text_config with
    # attention_chunk_size 8192 and an empty no_rope_layers (a NoPE/global layer every 4th layer:
    # 36 chunked + 12 full), 16 experts, max_position_embeddings 10,485,760; key set as in the
    # Maverick fixture of TensorRT-LLM's test_modeling_llama_min_latency.py (copied from the hub).
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": "llama-4-scout-17b-16e-instruct.json",
    # Qwen/Qwen3-Next-80B-A3B-Instruct: full_attention_interval 4 (36 Gated DeltaNet + 12 full
    # layers), GDN 16 key / 32 value heads of 128, conv kernel 4; the key set of a public copy of
    # the hub file (one with layers and vocabulary shrunk for a test).
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b-instruct.json",
    # mistralai/Mistral-7B-v0.1: sliding_window 4096 on every layer (transformers 4.34 file).
    "mistralai/Mistral-7B-v0.1": "mistral-7b-v0.1.json",
    # --- the models of the real start-up logs in tests/data/gpu_logs/ (issue 20). Each file is the hub's
    # config.json at the URL given, key for key; the log's own weights line checks the geometry
    # (tests/theory/test_budget_corpus.py prints weights logged vs counted).
    # https://huggingface.co/Qwen/Qwen2-7B-Instruct/blob/main/config.json: 7.62 B parameters (the
    # vLLM 0.10.1.1 log loads 14.25 GiB at TP 1).
    "Qwen/Qwen2-7B-Instruct": "qwen2-7b-instruct.json",
    # https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json; a public model report
    # quotes the same file with 72,706,203,648 parameters (transformers 4.43.1, max_window_layers 70).
    "Qwen/Qwen2.5-72B-Instruct": "qwen2.5-72b-instruct.json",
    # https://huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1/blob/main/config.json: 8 experts of
    # intermediate 14336, top-2, sliding_window null.
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b-instruct-v0.1.json",
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: 128 experts of 768, 8 active,
    # head_dim 128, 4 KV heads.
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b.json",
    # https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite-Chat/blob/main/config.json: MLA 512+64 with
    # no q_lora_rank, 64 routed + 2 shared experts of 1408, first layer dense.
    "deepseek-ai/DeepSeek-V2-Lite-Chat": "deepseek-v2-lite-chat.json",
    # https://huggingface.co/RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic/blob/main/config.json:
    # Llama-3.3-70B (the 3.1-70B geometry) with compressed-tensors FP8 weights by channel, dynamic
    # per-token activations, lm_head ignored.
    "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic": "llama-3.3-70b-instruct-fp8-dynamic.json",
    # https://huggingface.co/RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16/blob/main/config.json:
    # compressed-tensors pack-quantized int4, symmetric, group 128, lm_head ignored.
    "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16": "llama-3.1-8b-instruct-w4a16.json",
    # https://huggingface.co/RedHatAI/Mistral-Small-3.1-24B-Instruct-2503-quantized.w8a8/blob/main/config.json:
    # Mistral3ForConditionalGeneration (text 40 layers x 5120, vocab 131072; Pixtral vision tower, not
    # counted), compressed-tensors INT8 weights by channel, the vision tower, projector and lm_head ignored.
    "RedHatAI/Mistral-Small-3.1-24B-Instruct-2503-quantized.w8a8": "mistral-small-3.1-24b-instruct-2503-w8a8.json",
}


def list_presets() -> list[str]:
    return sorted(PRESETS)


def _read_json(path: str, source: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except OSError as err:
        raise ConfigError(f"cannot read model config: {err.strerror or err}", file=source) from err
    except json.JSONDecodeError as err:
        raise ConfigError(f"not valid JSON: {err.msg} at line {err.lineno}", file=source) from err
    if not isinstance(cfg, dict):
        raise ConfigError(f"expected a JSON object, got {type(cfg).__name__}", file=source)
    return cfg


def load_model_config(model: str, *, base_dir: str | None = None) -> tuple[dict, str]:
    """A preset HF id, a config.json path or a directory holding one -> (config dict, source)."""
    if model in PRESETS:
        text = resources.files("kvprobe.theory.model").joinpath("configs", PRESETS[model]).read_text("utf-8")
        return json.loads(text), f"preset {model} (kvprobe/theory/model/configs/{PRESETS[model]})"
    path = model if os.path.isabs(model) or base_dir is None else os.path.join(base_dir, model)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        return _read_json(path, path), path
    looks_like_id = "/" in model and not model.startswith((".", "/")) and not model.endswith(".json")
    if looks_like_id:
        raise ConfigError(
            f"unknown model {model!r}: not a packaged preset ({', '.join(list_presets())}) and no "
            f"config.json at {path!r}; pass a path to the model's config.json (nothing is downloaded)"
        )
    raise ConfigError(f"no model config at {path!r} (expected a config.json or a directory holding one)")
