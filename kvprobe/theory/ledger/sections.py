"""The capacity ledger as data: model -> budget -> capacity -> request -> admission.

One object holds every number kvprobe predicts for a configuration, with the binding limit named,
so a person can check the arithmetic line by line (`kvprobe.theory.ledger.text` renders it) and a
probe can compare it with the engine (`Ledger.to_dict`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.model.geometry import KVBytes, ModelGeometry
from kvprobe.theory.prediction import Prediction
from kvprobe.theory.sglang.budget import SglangBudget
from kvprobe.theory.sim.core import SglangConfig, VllmConfig
from kvprobe.theory.vllm.budget import VllmBudget


@dataclass
class ModelSection:
    geometry: ModelGeometry
    kv: KVBytes
    weight_bytes: int  # per rank
    source: str
    config: dict = field(default_factory=dict, repr=False)  # config.json as read (SGLang's hybrid layout)


@dataclass
class Capacity:
    num_blocks: int  # vLLM: as logged (null block included); SGLang: pages in the pool
    usable_blocks: int
    block_size: int
    bytes_per_block: int
    kv_tokens: int
    kv_tokens_upper: int | None
    max_concurrency_at_max_model_len: float
    max_model_len: int  # vLLM max_model_len / SGLang context_len
    max_running: int  # max_num_seqs / max_running_requests
    token_budget: int  # max_num_batched_tokens / chunked_prefill_size
    # a hybrid model's KV cache groups (vLLM): label, kind, copies, layers, block_size, and the
    # blocks one max-length request holds at most (the capacity line's divisor, per group)
    groups: list = field(default_factory=list)


@dataclass
class RequestSection:
    prompt_tokens: int
    output_tokens: int
    blocks_admission: int  # vLLM: blocks to admit; SGLang: tokens reserved at admission
    blocks_peak: int  # vLLM: peak blocks of one request; SGLang: peak tokens held
    unit: str  # "blocks" | "tokens"
    length_limit: int
    groups: list = field(default_factory=list)  # hybrid (vLLM): vllm/hybrid/groups.GroupBlocks as dicts


@dataclass
class Ledger:
    inputs: LedgerInputs
    model: ModelSection
    budget: VllmBudget | SglangBudget
    capacity: Capacity
    request: RequestSection | None
    admission: Prediction | None
    scheduler_config: VllmConfig | SglangConfig | None
    engine_version: str = ""
    # the engine's own text when it would refuse to start (build_ledger(explain_refusal=True))
    refusal: str | None = None
    not_predicted: str | None = None  # why admission is not predicted although the request is given
    # the release rule applied, per aspect ("memory profile", "admission policy", ...): (aspect, rule)
    release_rules: list = field(default_factory=list)
    # "not modelled since vLLM 0.20.0: ..." lines: release changes these inputs reach and kvprobe does not
    # model (kvprobe/theory/vllm/unmodelled.py, kvprobe/theory/sglang/unmodelled.py)
    not_modelled: list = field(default_factory=list)

    @property
    def startup(self) -> dict:
        """Would the engine start with this configuration; if not, why, in its own words, and the
        largest max-model-len that would fit the same pool (vLLM's estimate in that message)."""
        if self.refusal is None:
            return {"refused": False}
        fits = getattr(self.budget, "largest_max_model_len", None)
        return {"refused": True, "engine": self.inputs.engine, "message": self.refusal,
                "largest_max_model_len": fits or None}

    def to_dict(self) -> dict:
        g, kv = self.model.geometry, self.model.kv
        out = {
            "engine": self.inputs.engine,
            "engine_version": self.engine_version,
            "model": {
                "name": g.name, "source": self.model.source, "attention": g.attention,
                "num_layers": g.num_layers, "layers_per_rank": kv.layers_per_rank,
                "param_count": g.param_count, "dtype": g.dtype, "quantized_fp8": g.quantized_fp8,
                "quantized_mxfp4": g.quantized_mxfp4,
                "kv_cache_dtype": kv.dtype, "kv_bytes_per_token": kv.total,
                "kv_bytes_per_token_main": kv.main, "kv_bytes_per_token_indexer": kv.indexer,
                "kv_bytes_per_token_per_layer": kv.per_layer_main, "indexer_layers": g.indexer_layers,
                "weight_bytes": self.model.weight_bytes,
                "tp": self.inputs.tp, "pp": self.inputs.pp, "dp": self.inputs.dp,
            },
            "budget": {k: v for k, v in dataclasses.asdict(self.budget).items() if k not in ("plan", "pools")},
            "capacity": dataclasses.asdict(self.capacity),
            "request": dataclasses.asdict(self.request) if self.request else None,
            "admission": None,
            "scheduler_config": _scheduler_dict(self.scheduler_config),
            "startup": self.startup,
            "release_rules": [{"aspect": a, "rule": r} for a, r in self.release_rules],
            "not_modelled": list(self.not_modelled),
        }
        if self.admission is not None:
            a = dataclasses.asdict(self.admission)
            a["replicas"] = self.inputs.dp
            a["total_limit"] = a["limit"] * self.inputs.dp
            a["groups"] = [dict(g) for g in a.get("groups", ())]  # a JSON list
            out["admission"] = a
        return out


def _scheduler_dict(config) -> dict | None:
    if config is None:
        return None
    out = dataclasses.asdict(config)
    if "groups" in out:  # KV cache groups (vLLM): a JSON list of objects
        out["groups"] = [dict(g) for g in out["groups"]]
    return out
