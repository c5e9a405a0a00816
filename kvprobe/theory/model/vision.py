"""The vision tower and projector of a multimodal checkpoint, as vLLM 0.33.0 builds them beside the
language model: their parameters are in the weights memory the engine logs ("Model loading took").

Counted from `vision_config` for the towers read in vLLM's source; another tower is not counted (its
model_type is named in the ledger's parts list by its absence, as before). Linear layers are split by
TP (`mm_encoder_tp_mode` defaults to "weights", config/multimodal.py L385); embeddings and norms are
replicated. The tower stays in the model dtype: quantised checkpoints leave it out (their `ignore`).

* SigLIP (Gemma-3, `siglip_vision_model`; models/siglip.py, gemma3_mm.py Gemma3MultiModalProjector):
  qkv and out projections with biases, fc1/fc2 with biases, two LayerNorms per layer; patch conv with
  bias, a learned position per patch, post LayerNorm; projector `mm_input_projection_weight`
  (vision hidden x text hidden) and its RMSNorm.
* Pixtral (Mistral-3, `pixtral`; models/pixtral.py PixtralHF*, mistral3.py): qkv/o and a gated MLP
  without biases, two RMSNorms per layer; patch conv without bias, ln_pre; projector RMSNorm, patch
  merger (hidden x merge^2 -> hidden), linear_1 and linear_2 (biases per `multimodal_projector_bias`).
* Llama-4 (`llama4_vision_model`; models/mllama4.py): qkv/o and fc1/fc2 with biases, two LayerNorms per
  layer; unfold-conv linear without bias, class embedding, positions for patches + 1, pre/post
  LayerNorm; pixel-shuffle MLP (intermediate -> projector_input -> projector_output); projector
  linear_1 (vision_output_dim -> text hidden).
"""

from __future__ import annotations

from kvprobe.theory.model.weights import Parts


def _lin(p: Parts, name: str, out_f: int, in_f: int, *, bias: bool, times: int = 1) -> None:
    """A TP-split linear layer (times: one per encoder layer), on the first PP stage with the embeddings."""
    params = times * (out_f * in_f + (out_f if bias else 0))
    p.plain(f"vision.{name}", params, "tp", stage="first")


def _rep(p: Parts, name: str, params: int) -> None:
    p.plain(f"vision.{name}", params, "replicated", stage="first")


def vision_parts(p: Parts, cfg: dict, text_hidden: int) -> str:
    """Add the tower's parts; returns the tower counted ("" when none or not read)."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        return ""
    kind = str(v.get("model_type", ""))
    h, inter, n = v.get("hidden_size"), v.get("intermediate_size"), v.get("num_hidden_layers")
    patch, image, ch = v.get("patch_size"), v.get("image_size"), v.get("num_channels") or 3
    if not all(isinstance(x, int) and x > 0 for x in (h, inter, n, patch, image)):
        return ""
    patches = (image // patch) ** 2
    if kind == "siglip_vision_model":
        _lin(p, "qkv_proj", 3 * h, h, bias=True, times=n)
        _lin(p, "out_proj", h, h, bias=True, times=n)
        _lin(p, "fc1", inter, h, bias=True, times=n)
        _lin(p, "fc2", h, inter, bias=True, times=n)
        _rep(p, "layer_norms", n * 4 * h)
        _rep(p, "patch_embedding", ch * patch * patch * h + h)
        _rep(p, "position_embedding+post_layernorm", patches * h + 2 * h)
        _rep(p, "mm_input_projection+norm", h * text_hidden + h)
        return kind
    if kind == "pixtral":
        _lin(p, "qkv_proj", 3 * h, h, bias=False, times=n)
        _lin(p, "o_proj", h, h, bias=False, times=n)
        _lin(p, "gate_up_proj", 2 * inter, h, bias=False, times=n)
        _lin(p, "down_proj", h, inter, bias=False, times=n)
        _rep(p, "norms", n * 2 * h)
        merge = cfg.get("spatial_merge_size") or 2
        bias = bool(cfg.get("multimodal_projector_bias"))
        _rep(p, "patch_conv+ln_pre", ch * patch * patch * h + h)
        _rep(p, "projector.norm+patch_merger", h + h * h * merge * merge)
        _rep(p, "projector.linear_1+linear_2", text_hidden * h + text_hidden * text_hidden
             + (2 * text_hidden if bias else 0))
        return kind
    if kind == "llama4_vision_model":
        _lin(p, "qkv_proj", 3 * h, h, bias=True, times=n)
        _lin(p, "o_proj", h, h, bias=True, times=n)
        _lin(p, "fc1", inter, h, bias=True, times=n)
        _lin(p, "fc2", h, inter, bias=True, times=n)
        _rep(p, "layer_norms", n * 4 * h)
        _rep(p, "patch_embedding+class+positions+norms", ch * patch * patch * h + h + (patches + 1) * h + 4 * h)
        bias = bool(v.get("multi_modal_projector_bias"))
        p_in, p_out = v.get("projector_input_dim") or inter, v.get("projector_output_dim") or inter
        _lin(p, "adapter.fc1", p_in, inter, bias=bias)
        _lin(p, "adapter.fc2", p_out, p_in, bias=bias)
        _lin(p, "multi_modal_projector", text_hidden, v.get("vision_output_dim") or p_out, bias=False)
        return kind
    return ""
