"""Release changes kvprobe has no model for (kvprobe/theory/vllm/unmodelled.py,
kvprobe/theory/sglang/unmodelled.py): each row applies on its side of its release and only when the
inputs reach the change; the ledger then prints "not modelled since/before ..." (and lists it in
its JSON) and, unless the change moves only a reported figure, predicts no admission. The rows'
releases are checked against release-changes.md's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvprobe.engines.vllm.versions import async_scheduling_default
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.ledger.text import render_ledger
from kvprobe.theory.model.layers import FULL, LINEAR, SLIDING
from kvprobe.theory.sglang import memory_profile as sglang_memory
from kvprobe.theory.sglang import releases as sglang_releases
from kvprobe.theory.sglang.unmodelled import ROWS as SGLANG_ROWS
from kvprobe.theory.sglang.unmodelled import SglangFacts
from kvprobe.theory.sglang.unmodelled import unmodelled as sglang_unmodelled
from kvprobe.theory.vllm import memory_profile as vllm_memory
from kvprobe.theory.vllm import releases as vllm_releases
from kvprobe.theory.vllm import unmodelled as vllm_unmodelled_module
from kvprobe.theory.vllm.unmodelled import ROWS as VLLM_ROWS
from kvprobe.theory.vllm.unmodelled import VllmFacts
from kvprobe.theory.vllm.unmodelled import unmodelled as vllm_unmodelled

GIB = 2**30
WINDOW = (SLIDING, FULL) * 12  # gpt-oss-like: a window on every other layer
MAMBA = (LINEAR, LINEAR, LINEAR, FULL) * 12  # Qwen3-Next-like


def vllm_entries(**kw) -> list[str]:
    return [f"{r.entry}@{r.release}" for r in vllm_unmodelled(VllmFacts(**kw))]


def sglang_entries(**kw) -> list[str]:
    return [f"{r.entry}@{r.release}" for r in sglang_unmodelled(SglangFacts(**kw))]


# (row, version on the modelled side, on the unmodelled side, inputs that reach it, inputs that do not)
VLLM_CASES = {
    "V3@0.20.0": ("0.19.1", "0.20.0", dict(kinds=MAMBA, max_num_seqs=1024, num_blocks=856, prefix_caching=False),
                  dict(kinds=MAMBA, max_num_seqs=256, num_blocks=856, prefix_caching=False)),
    "V7@0.20.1/startup": ("0.20.1", "0.20.0", dict(num_gpu_blocks_override=400, refused=True),
                          dict(num_gpu_blocks_override=400)),
    "V10@0.28.0": ("0.28.0", "0.27.1", dict(gpu_memory_bytes=180 * GIB),
                   dict(gpu_memory_bytes=180 * GIB, max_num_batched_tokens_given=True)),
    "V14@0.14.0": ("0.14.0", "0.13.0", dict(max_model_len_auto=True), dict()),
    # the extensible KV cache sizes a profiled pool after warm-up; a pool given (or the flag off) turns it off
    "V16@0.34.0": ("0.33.0", "0.34.0", dict(pool_after_warmup=True, gpu_memory_bytes=80 * GIB),
                   dict(pool_after_warmup=False, gpu_memory_bytes=80 * GIB)),
}


@pytest.mark.parametrize("case", sorted(VLLM_CASES))
def test_a_vllm_row_applies_on_its_side_and_only_when_the_inputs_reach_it(case):
    entry = case.split("/")[0]
    kind = case.split("/")[1] if "/" in case else None
    modelled, unmodelled, reach, miss = VLLM_CASES[case]
    effect = {r.effect for r in VLLM_ROWS if f"{r.entry}@{r.release}" == entry}
    assert kind is None or kind in effect

    def hits(version, inputs):
        rows = vllm_unmodelled(VllmFacts(version=version, **inputs))
        return [r for r in rows if f"{r.entry}@{r.release}" == entry and (kind is None or r.effect == kind)]

    assert hits(unmodelled, reach), (case, "the unmodelled side with inputs that reach the change")
    assert not hits(modelled, reach), (case, "the modelled side")
    assert not hits(unmodelled, miss), (case, "inputs that do not reach the change")
    assert not hits(modelled, miss)


def test_v15_reaches_only_a_class_that_supports_mamba_prefix_caching(monkeypatch):
    """0.18.1-0.27.1 resolve 'all' only for SupportsMambaPrefixCaching classes: Qwen3-Next's Gated DeltaNet
    resolves 'align' there too (run on both releases' engines: expectations/diff/vllm-mamba-cache-mode-shadow.yaml),
    so the row does not fire for it; for a kind whose class does, it fires before 0.28.0 with prefix caching."""
    qwen3_next = dict(kinds=MAMBA, prefix_caching=True)
    assert "V15@0.28.0" not in vllm_entries(version="0.27.1", **qwen3_next)
    monkeypatch.setattr(vllm_unmodelled_module, "ALL_MODE_KINDS", frozenset({LINEAR}))  # as if LINEAR were Mamba2's
    assert "V15@0.28.0" in vllm_entries(version="0.27.1", **qwen3_next)
    assert "V15@0.28.0" not in vllm_entries(version="0.28.0", **qwen3_next)
    assert "V15@0.28.0" not in vllm_entries(version="0.27.1", kinds=MAMBA, prefix_caching=False)


SGLANG_CASES = {
    # M = 372,416, ctx 40,960: the estimate 4096 (clamped), M // 2 = 186,208
    "S5@0.5.14": (("0.5.14", "0.5.13", "0.5.10"),
                  dict(max_total_num_tokens=372_416, context_len=40_960, max_running_requests=8192),
                  dict(max_total_num_tokens=372_416, context_len=40_960, max_running_requests=1024)),
    # page 64, M = 4096, P = 1000 (1024 in pages): the memory clip is 4096 - 1024 - 64 - 1 = 3007
    "S8@0.5.21": (("0.5.21", "0.5.20", "0.5.13"),
                  dict(max_total_num_tokens=4096, page_size=64, prompt_tokens=1000, output_tokens=3050),
                  dict(max_total_num_tokens=4096, page_size=64, prompt_tokens=1000, output_tokens=3000)),
}


@pytest.mark.parametrize("entry", sorted(SGLANG_CASES))
def test_an_sglang_row_applies_on_its_side_and_only_when_the_inputs_reach_it(entry):
    (modelled, *unmodelled), reach, miss = SGLANG_CASES[entry]
    assert entry not in sglang_entries(version=modelled, **reach)
    for version in unmodelled:
        assert entry in sglang_entries(version=version, **reach), version
        assert entry not in sglang_entries(version=version, **miss), version


def test_the_0_5_9_running_cap_is_used_as_given_up_to_half_the_pool():
    """Up to 0.5.9 the value was taken as given: only a value above M // 2 differs from 0.5.14's."""
    assert "S5@0.5.14" not in sglang_entries(version="0.5.9", max_total_num_tokens=372_416, context_len=40_960,
                                             max_running_requests=8192)
    assert "S5@0.5.14" in sglang_entries(version="0.5.9", max_total_num_tokens=10_000, context_len=4096,
                                         max_running_requests=8192)


def test_every_row_cites_the_engine_and_says_its_side():
    for row in (*VLLM_ROWS, *SGLANG_ROWS):
        assert row.sources and all(re.search(r"\.py", s) or "release-changes.md" in s for s in row.sources), row
        assert row.line().startswith(f"not modelled {row.side} {row.engine} {row.release}: ")


# --- the ledger -------------------------------------------------------------------------------------

def vllm_ledger(version: str, **kw):
    base = dict(engine="vllm", model="meta-llama/Llama-3.1-8B", engine_version=version, max_model_len=8192,
                max_num_seqs=64, prompt_tokens=512, output_tokens=256, async_scheduling=True)
    return build_ledger(LedgerInputs(**{**base, **kw}))


def test_the_ledger_says_not_modelled_and_predicts_nothing_on_the_changed_side():
    """V10: on a 180 GiB card 0.27 defaulted max_num_batched_tokens to 8192, the ledger's tiers to 16384."""
    old = vllm_ledger("0.27.1", gpu_memory_bytes=180 * GIB)
    line = ("not modelled before vLLM 0.28.0: a GPU of 160 GiB or more got the 70 GiB tier's "
            "max_num_batched_tokens 8192")
    assert [n[:len(line)] for n in old.not_modelled] == [line]
    assert old.admission is None and old.not_predicted.startswith(line)
    d = json.loads(json.dumps(old.to_dict()))
    assert d["admission"] is None and [n[:len(line)] for n in d["not_modelled"]] == [line]
    text = render_ledger(old)
    assert f"admission: not predicted ({line}" in text and f"\n{line}" in text
    new = vllm_ledger("0.28.0", gpu_memory_bytes=180 * GIB)
    assert new.not_modelled == [] and new.admission is not None
    given = vllm_ledger("0.27.1", gpu_memory_bytes=180 * GIB, max_num_batched_tokens=8192)
    assert given.not_modelled == [] and given.admission is not None


def test_the_kv_cache_size_line_is_the_releases():
    """V7: before 0.20.1 "GPU KV cache size" is num_blocks // groups x the smallest block size
    (kv_cache_utils.py L1299-1303 in 0.18.1), from it int(max_concurrency x max_model_len); with
    max_model_len 8190 (not a multiple of 16) the two differ, the blocks do not."""
    old = vllm_ledger("0.20.0", gpu_memory_bytes=24 * GIB, max_model_len=8190)
    new = vllm_ledger("0.20.1", gpu_memory_bytes=24 * GIB, max_model_len=8190)
    assert old.not_modelled == [] == new.not_modelled and old.admission is not None
    blocks = old.budget.num_blocks
    assert blocks == new.budget.num_blocks and old.capacity.kv_tokens == blocks * 16
    assert new.capacity.kv_tokens == int(blocks / 512 * 8190) != old.capacity.kv_tokens
    assert dict(old.release_rules)["KV cache size figure"].startswith("num_blocks // groups")


def test_sglang_ledger_says_the_running_cap_is_not_modelled_before_0_5_14():
    base = dict(engine="sglang", model="Qwen/Qwen3-8B", gpu_memory_bytes=80 * GIB, prompt_tokens=2048,
                output_tokens=512, max_running_requests=8192)
    old = build_ledger(LedgerInputs(engine_version="0.5.13", **base))
    assert [n.split(":")[0] for n in old.not_modelled] == ["not modelled before SGLang 0.5.14"]
    assert old.admission is None and "--max-running-requests" in old.not_predicted
    new = build_ledger(LedgerInputs(engine_version="0.5.14", **base))
    assert new.not_modelled == [] and new.admission is not None


@pytest.mark.parametrize("engine,version,aspects", [
    ("vllm", "0.18.1", {"memory profile", "max_num_seqs / max_num_batched_tokens", "scheduling",
                        "KV cache size figure", "block size", "admission policy"}),
    ("sglang", "0.5.13", {"mem_fraction_static", "max_running_requests", "max_new_tokens", "scheduler loop",
                          "admission policy"}),
])
def test_the_ledger_names_the_release_rules_it_applied(engine, version, aspects):
    kw = dict(max_model_len=8192) if engine == "vllm" else dict(context_length=8192)
    led = build_ledger(LedgerInputs(engine=engine, model="meta-llama/Llama-3.1-8B", engine_version=version,
                                    gpu_memory_bytes=24 * GIB, prompt_tokens=512, output_tokens=256, **kw))
    rules = dict(led.release_rules)
    assert set(rules) == aspects
    policy = {"vllm": "vllm-0.11", "sglang": "sglang-0.5.21"}[engine]
    assert rules["admission policy"].startswith(policy)
    text = render_ledger(led)
    assert "release rules" in text and rules["admission policy"] in text
    if engine == "vllm":
        assert rules["memory profile"].startswith("vLLM 0.18.0 rules")
        assert "first chunk" in text  # 0.18.1 admits by the first chunk: the request table says so
    else:
        assert "SGLang 0.5.10-0.5.19 rules" in rules["mem_fraction_static"]
        # both older scheduler-loop rules (kvprobe/theory/sglang/releases.py scheduler_rules)
        assert "next decode step, up to 0.5.22" in rules["scheduler loop"] and "last, up to 0.5.21" in text


# --- the releases against release-changes.md --------------------------------------------------------

REFERENCE = Path(__file__).parents[1] / "data" / "reference" / "release-changes.md"
# The first release of each entry as release-changes.md states it (copied, so the check runs without
# the file; checked against the file below when it is there).
REFERENCE_RELEASES = {"V1": "0.19.0", "V2": "0.20.0", "V3": "0.20.0", "V4": "0.20.0", "V5": "0.26.0",
                      "V6": "0.14.0", "V7": "0.21.0", "V10": "0.28.0", "V14": "0.14.0", "V15": "0.33.0",
                      "S1": "0.5.22", "S2": "0.5.3", "S3": "0.5.10", "S5": "0.5.14", "S8": "0.5.21", "S10": "0.5.19"}
# Where kvprobe read the wheel and found otherwise.
READ_OTHERWISE = {
    "S10": "0.5.20",  # 0.5.19 arg_groups/memory_hook.py L74-87: still 2048 / 24 in the 20-35 GiB tier
    "V7": "0.20.1",  # 0.20.1 v1/core/kv_cache_utils.py L1699-1706, L1982-2002 (0.20.0 L1694-1698, L893-909)
    "V15": "0.28.0",  # 0.28.0 model_executor/models/config.py L603-604 "align" (0.27.1 L614-617 "all")
}


def _first(rules, pred) -> str:
    return next(r.release for r in rules if pred(r))


def kvprobe_releases() -> dict[str, str]:
    """The release at which kvprobe's own rules (and its unmodelled rows) put each entry."""
    out = {f"{r.entry}": r.release for r in (*VLLM_ROWS, *SGLANG_ROWS)}
    out["V1"] = ".".join(map(str, vllm_releases.FULL_PROMPT_FROM)) + ".0"
    out["V4"] = next(v for v in ("0.19.1", "0.20.0") if vllm_releases.window_rules(v).admission_cap)
    out["V5"] = next(v for v in ("0.25.1", "0.26.0") if vllm_releases.window_rules(v).in_flight)
    out["V2"] = _first(vllm_memory.RULES, lambda r: r.cudagraph == "subtracted" and r.gpu_memory_utilization == 0.92)
    out["V6"] = next(v for v in ("0.13.0", "0.14.0") if async_scheduling_default(v))
    out["S1"] = next(v for v in ("0.5.21", "0.5.22") if sglang_releases.policy(v) == "sglang-0.5.22")
    out["S2"] = _first(sglang_memory.RULES, lambda r: r.fraction == "reserved-formula")
    out["S3"] = _first(sglang_memory.RULES, lambda r: r.prefill_graphs)
    out["S10"] = _first(sglang_memory.RULES, lambda r: r.mid_tier[0] == 4096)
    return out


def test_kvprobes_releases_agree_with_release_changes_md():
    ours = kvprobe_releases()
    for entry, release in REFERENCE_RELEASES.items():
        assert ours[entry] == READ_OTHERWISE.get(entry, release), entry


def test_the_copied_releases_are_release_changes_mds():
    text = REFERENCE.read_text()
    for entry, release in REFERENCE_RELEASES.items():
        section = re.search(rf"^### {entry}\. .*?(?=^### |^---)", text, re.M | re.S)
        assert section is not None, entry
        assert release in section.group(0), (entry, release)


def test_a_probe_of_an_unmodelled_configuration_stops_with_the_line(tmp_path):
    """`--max-model-len auto` does not exist before 0.14.0 (and an override fed no auto-fit before
    0.20.1): a probe has nothing to judge against; from 0.20.1 both are modelled."""
    import yaml

    from kvprobe.errors import ConfigError
    from kvprobe.probe.run import predict
    from kvprobe.spec.expectation import load_expectations

    def expectation(version: str):
        doc = {"engine": "vllm", "version": version, "model": "meta-llama/Llama-3.1-8B",
               "flags": {"num-gpu-blocks-override": 201, "max-model-len": "auto"},
               "target": {"launch": "emulator"}, "profile": "short"}
        path = tmp_path / version / "exp.yaml"
        path.parent.mkdir(parents=True)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return load_expectations(path)[0]

    wanted = (r"expected a release and flags kvprobe models: not modelled before vLLM 0\.20\.1: .*; "
              r"not modelled before vLLM 0\.14\.0: --max-model-len auto")
    with pytest.raises(ConfigError, match=wanted):
        predict(expectation("0.13.0"))
    assert predict(expectation("0.20.1")).admission is not None
