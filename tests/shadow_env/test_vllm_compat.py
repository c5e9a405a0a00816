"""`kvprobe.targets.shadow.vllm.compat`: each interface's threshold takes the right branch per vLLM release,
without an engine environment (a stand-in `vllm` package carries the version and the two names the new
branches import)."""

from __future__ import annotations

import importlib
import sys
import types
from collections import namedtuple

import pytest

MODULE = "kvprobe.targets.shadow.vllm.compat"
RELEASES = ["0.18.1", "0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.23.0", "0.24.0", "0.25.1", "0.33.0", "0.34.0"]


def _stand_in_vllm(monkeypatch, version: str) -> None:
    """A `vllm` whose `__version__` is `version`, with 0.33's `CompilationTimes`, `get_kv_quant_mode` and
    `_DEFAULT_LAYOUT_PREFERENCE` (the names compat imports on the new side), and a `ModelRunnerOutput` that
    returns its keywords."""
    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.worker_base", "vllm.v1.kv_cache_interface",
        "vllm.v1.attention", "vllm.v1.attention.backends", "vllm.v1.attention.backends.utils", "vllm.v1.outputs",
        "vllm.v1.attention.backends.registry")}
    modules["vllm.v1.outputs"].ModelRunnerOutput = lambda **kw: kw  # the keywords the worker passes
    modules["vllm"].__version__ = version
    modules["vllm.v1.worker.worker_base"].CompilationTimes = namedtuple("CompilationTimes", "language_model encoder")
    modules["vllm.v1.kv_cache_interface"].get_kv_quant_mode = lambda dtype: f"mode({dtype})"
    modules["vllm.v1.attention.backends.utils"]._DEFAULT_LAYOUT_PREFERENCE = [types.SimpleNamespace(name="NHD")]
    modules["vllm.v1.attention.backends.registry"].MambaAttentionBackendEnum = {"GDN_ATTN": "<GDN_ATTN>"}
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.fixture
def compat_of(monkeypatch):
    def load(version: str):
        _stand_in_vllm(monkeypatch, version)
        monkeypatch.delitem(sys.modules, MODULE, raising=False)
        return importlib.import_module(MODULE)
    yield load
    # the next importer gets the real one (kvprobe's own environment has no vllm: it never imported here)
    sys.modules.pop(MODULE, None)
    package = sys.modules.get(MODULE.rpartition(".")[0])
    if package is not None and hasattr(package, "compat"):
        delattr(package, "compat")


class _Spec:
    page_size_bytes = 100


@pytest.mark.parametrize("version", RELEASES)
def test_each_interface_takes_its_release_branch(compat_of, version):
    compat = compat_of(version)
    v = tuple(int(p) for p in version.split("."))
    # 0.20.2 is the first release read with CompilationTimes, kv_quant_mode and the override applied before
    # the bytes check (compat.py's table); the layout RPC, 0.33's spec fields and the planner module come
    # after 0.25.1
    new_worker = v >= (0, 20, 2)
    assert compat.compile_times() == ((0.0, 0.0) if new_worker else 0.0)
    assert type(compat.compile_times()).__name__ == ("CompilationTimes" if new_worker else "float")
    assert compat.quant_fields("fp8") == ({"kv_quant_mode": "mode(fp8)"} if new_worker else {})
    assert compat.override_pool_bytes(2000, {"a": _Spec(), "b": _Spec()}) == (0 if new_worker else 400_000)
    new_specs = v >= (0, 33, 0)
    assert compat.default_kv_cache_layouts() == (["NHD"] if new_specs else [])
    assert compat.PLANNER_MODULE is new_specs
    reason = compat.refusal("a DSA indexer")
    assert (reason is None) if new_specs else f"models on vLLM {version}; this model has a DSA" in reason


@pytest.mark.parametrize(("threshold", "old", "new"), [
    ("COMPILE_TIMES_FLOAT_THROUGH", "0.19.1", "0.20.0"), ("NO_LAYOUT_RPC_THROUGH", "0.25.1", "0.33.0"),
    ("OLD_SPEC_FIELDS_THROUGH", "0.25.1+cpu", "0.33.0"), ("MAMBA_STR_TYPE_THROUGH", "0.20.2", "0.21.0"),
    ("MAMBA_NO_CHECKPOINTS_THROUGH", "0.28.0", "0.29.0"), ("MAMBA_NO_ALIGNMENT_THROUGH", "0.29.0", "0.30.0")])
def test_thresholds_name_the_newest_release_with_the_old_form(compat_of, threshold, old, new):
    compat = compat_of("0.33.0")
    assert compat.through(getattr(compat, threshold), old) and not compat.through(getattr(compat, threshold), new)


@pytest.mark.parametrize(("version", "fields"), [
    ("0.18.1", {"cache_dtype_str"}), ("0.25.1", {"cache_dtype_str"}),
    ("0.26.0", {"cache_dtype_str", "kv_quant_mode"}), ("0.27.1", {"cache_dtype_str", "kv_quant_mode"}),
    ("0.28.0", {"cache_dtype_str", "kv_quant_mode", "state_content_bytes"}),
    ("0.30.0", {"cache_dtype_str", "kv_quant_mode", "state_content_bytes"}),
    ("0.31.0", {"cache_dtype_str", "kv_quant_mode", "state_content_bytes", "max_tp_shards"}),
    ("0.33.0", {"cache_dtype_str", "kv_quant_mode", "state_content_bytes", "max_tp_shards"})])
def test_the_mla_spec_takes_the_fields_its_releases_mla_layer_passes(compat_of, version, fields):
    compat = compat_of(version)
    got = compat.mla_fields("fp8_ds_mla")
    assert set(got) == fields
    assert got["cache_dtype_str"] == "fp8_ds_mla" and got.get("state_content_bytes", 656) == 656
    assert got.get("max_tp_shards", 1) == 1


@pytest.mark.parametrize(("version", "dsa", "mamba"), [
    ("0.18.1", True, False), ("0.24.0", True, False), ("0.25.1", True, False), ("0.27.1", True, False),
    ("0.28.0", True, False), ("0.29.0", True, False), ("0.30.0", False, False), ("0.32.0", False, False),
    ("0.33.0", False, False), ("0.34.0", False, False)])
def test_dsa_is_refused_through_0_29_and_mamba_never(compat_of, version, dsa, mamba):
    """Mamba specs are written on every release read (0.18.1-0.34.0), with the `mamba_type` and checkpoint
    fields each release's MambaSpec has; DSA indexers are refused through 0.29.0, naming the release."""
    compat = compat_of(version)
    for kind, refused in ((compat.DSA_KIND, dsa), (compat.MAMBA_KIND, mamba)):
        reason = compat.refusal(kind)
        assert (reason is not None) is refused, (kind, reason)
        if refused:
            assert f"on vLLM {version}; this model has {kind}" in reason
            # what the release is described with: Mamba named where it is written
            assert ("Mamba models" in reason) is (not mamba), reason
    width = {"topk_buffer_width": 2048} if version in ("0.33.0", "0.34.0") else {}
    assert compat.dsa_leader_fields(2048, True) == {"is_index_group_leader": True, **width}


@pytest.mark.parametrize(("version", "sliding_head_v"), [("0.18.1", False), ("0.19.1", False), ("0.20.2", True),
                                                        ("0.27.1", True), ("0.33.0", True)])
def test_window_specs_take_the_value_head_field_their_release_has(compat_of, version, sliding_head_v):
    """SlidingWindowSpec has no head_size_v through 0.19.1 (kv_cache_interface.py L248-249), its own from
    0.20.2; FullAttentionSpec always; ChunkedLocalAttentionSpec never. Window models are not refused."""
    compat = compat_of(version)
    assert compat.attention_fields("SlidingWindowSpec", 64) == ({"head_size_v": 64} if sliding_head_v else {})
    assert compat.attention_fields("FullAttentionSpec", 64) == {"head_size_v": 64}
    assert compat.attention_fields("ChunkedLocalAttentionSpec", 64) == {}
    assert not hasattr(compat, "HYBRID_KIND") and set(compat.REFUSED) == {compat.DSA_KIND, compat.MAMBA_KIND}


CHECKPOINTED = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 576}


@pytest.mark.parametrize(("version", "fields"), [("0.25.1", {}), ("0.27.1", {}), ("0.28.0", {}),
                                                 ("0.29.0", {"num_prefill_checkpoint_blocks": 1}),
                                                 ("0.30.0", CHECKPOINTED), ("0.32.0", CHECKPOINTED),
                                                 ("0.33.0", CHECKPOINTED)])
def test_mamba_specs_take_the_prefill_checkpoint_fields_their_release_has(compat_of, version, fields):
    """0.28.0's MambaSpec has no prefill-checkpoint fields (kv_cache_interface.py L668-674; the dataclass
    refuses unknown keywords), 0.29.0 adds num_prefill_checkpoint_blocks (L858), 0.30.0 its alignment (L1001).
    The values are the layer spec's, whatever they are."""
    compat = compat_of(version)
    spec = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 576, "mamba_cache_mode": "align"}
    assert compat.mamba_fields(spec) == fields
    assert compat.MAMBA_NO_CHECKPOINTS is (not fields)
    none = {"num_prefill_checkpoint_blocks": 0, "prefill_checkpoint_alignment": None}
    assert compat.mamba_fields(none) == {k: none[k] for k in fields}


@pytest.mark.parametrize(("version", "expected"), [("0.18.1", "gdn_attention"), ("0.20.2", "gdn_attention"),
                                                   ("0.21.0", "<GDN_ATTN>"), ("0.33.0", "<GDN_ATTN>")])
def test_a_gdn_layers_mamba_type_is_a_str_through_0_20_and_the_enum_after(compat_of, version, expected):
    """MambaSpec's `mamba_type: str` (kv_cache_interface.py L525 in 0.20.2; "gdn_attention", the layer's own
    property, gdn_linear_attn.py L217-218) / the MambaAttentionBackendEnum from 0.21.0 (L547)."""
    assert compat_of(version).mamba_type("gdn_attn") == expected


def test_mamba_is_refused_on_no_release_read(compat_of):
    compat = compat_of("0.33.0")
    assert not any(compat.refused(compat.MAMBA_KIND, v) for v in ("0.18.1", "0.24.0", "0.28.0", "0.32.0", "0.33.0"))


@pytest.mark.parametrize("version", ["0.18.1", "0.25.1", "0.33.0", "0.34.0"])
def test_the_step_output_has_req_id_to_index_through_0_33(compat_of, version):
    """0.33.0's ModelRunnerOutput requires req_id_to_index (v1/outputs.py L271); 0.34.0 has no such field."""
    compat = compat_of(version)
    got = compat.runner_output(["a", "b"], [[7], []])
    expected = {"req_ids": ["a", "b"], "sampled_token_ids": [[7], []]}
    if version != "0.34.0":
        expected["req_id_to_index"] = {"a": 0, "b": 1}
    assert got == expected


def _new_request(prompt: int, prefill: int | None, embeds: int | None = None):
    return types.SimpleNamespace(
        prompt_token_ids=None if embeds else list(range(prompt)),
        prompt_embeds=types.SimpleNamespace(shape=(embeds,)) if embeds else None,
        prefill_token_ids=None if prefill is None else list(range(prefill)))


def test_a_request_resumed_as_new_carries_its_generated_tokens(compat_of):
    """0.34.0 re-sends a preempted request as NewRequestData with prefill_token_ids = prompt + generated
    (scheduler.py L1714-1723): the worker's known length must count them. A fresh request (prefill = prompt)
    and 0.33.0's V1 path (prefill_token_ids None, or no such attribute before it) have generated nothing."""
    compat = compat_of("0.34.0")
    assert compat.output_len(_new_request(100, 145)) == 45
    assert compat.output_len(_new_request(100, 100)) == 0
    assert compat.output_len(_new_request(100, None)) == 0
    assert compat.output_len(types.SimpleNamespace(prompt_token_ids=[1, 2], prompt_embeds=None)) == 0
    assert compat.output_len(_new_request(0, 12, embeds=10)) == 2


def test_the_memory_fraction_is_the_engines_resolved_one(compat_of):
    """0.34.0's gpu_memory_utilization defaults to None and the engine sizes by
    resolved_gpu_memory_utilization (config/cache.py L494-501); earlier releases have the field alone."""
    compat = compat_of("0.34.0")
    assert compat.gpu_memory_utilization(types.SimpleNamespace(gpu_memory_utilization=None,
                                                               resolved_gpu_memory_utilization=0.92)) == 0.92
    assert compat.gpu_memory_utilization(types.SimpleNamespace(gpu_memory_utilization=0.8,
                                                               resolved_gpu_memory_utilization=0.8)) == 0.8
    assert compat.gpu_memory_utilization(types.SimpleNamespace(gpu_memory_utilization=0.92)) == 0.92
