"""SGLang's info endpoints (0.5.23): /v1/models and /server_info, read back into a
ReportedCapacity with the flags the engine publishes."""

from __future__ import annotations

from kvprobe.engines.base import ReportedCapacity
from kvprobe.engines.sglang.flags import FLAGS
from kvprobe.engines.sglang.http import MODELS_PATH, SERVER_INFO_PATHS


def _published_flags(body: dict) -> dict[str, object]:
    """/server_info holds every server argument under its field name (ServerArgs.resolved_dict,
    server_args.py L316-333: the value after resolution, e.g. the GPU tier's chunked_prefill_size).
    None is a flag left unset; context_length stays None unless given (the model's own length is
    /v1/models' max_model_len), so an unset context_length is not published here."""
    flags = {}
    for name, flag in FLAGS.items():
        if name in ("api-key", "served-model-name") or flag.dest not in body:
            continue
        value = body[flag.dest]
        if value is None and name == "context-length":
            continue
        flags[name] = value
    return flags


def reported_from_info(path: str, body: dict) -> ReportedCapacity:
    if path == MODELS_PATH:
        # http_server.py L1993-2022: id = root = the served name, max_model_len = context_len
        data = (body.get("data") or [{}])[0]
        out = {"max_model_len": data.get("max_model_len"), "served_model_name": data.get("id")}
        out = {k: v for k, v in out.items() if v is not None}
        flags = {"context-length": out["max_model_len"]} if "max_model_len" in out else {}
        return ReportedCapacity(**out, flags=flags, sources={**{k: path for k in out},
                                                             **{f"flags.{k}": path for k in flags}})
    if path in SERVER_INFO_PATHS:
        states = body.get("internal_states") or [{}]
        cps = body.get("chunked_prefill_size")
        out = {"kv_tokens": body.get("max_total_num_tokens"), "max_req_input_len": body.get("max_req_input_len"),
               "max_model_len": body.get("context_length"), "block_size": body.get("page_size"),
               "max_running": states[0].get("effective_max_running_requests_per_dp"),
               "token_budget": cps if isinstance(cps, int) and cps > 0 else None, "version": body.get("version"),
               "served_model_name": body.get("served_model_name"), "model_path": body.get("model_path")}
        out = {k: v for k, v in out.items() if v is not None}
        flags = _published_flags(body)
        return ReportedCapacity(**out, flags=flags, sources={**{k: path for k in out},
                                                             **{f"flags.{k}": path for k in flags}})
    return ReportedCapacity()
