"""`kvprobe diff`: the same expectation on several engine releases. The changes between two releases'
figures (beyond tolerance, explained by the ledger's rule or not) without an engine; end to end on the
emulator, the two shipped pairs where the releases admit differently (vLLM 0.11 first-chunk against
0.33 whole-prompt admission, SGLang 0.5.21 against 0.5.23's ignore_eos reservation), the same release
twice, and the bad inputs refused before anything is launched."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kvprobe.probe.diff import _per_1k_steps, labels, memory_figures
from kvprobe.probe.diff_changes import UNEXPLAINED, find_changes
from kvprobe.report.diff import change_line, diff_table
from kvprobe.spec.schema import Tolerances
from kvprobe.theory.ledger.build import LedgerInputs, build_ledger
from kvprobe.theory.sglang.releases import scheduler_rule_text
from tests.cli.console import run

REPO = Path(__file__).resolve().parents[2]
VLLM_PAIR = str(REPO / "expectations" / "diff" / "vllm-first-chunk.yaml")
SGLANG_PAIR = str(REPO / "expectations" / "diff" / "sglang-ignore-eos.yaml")
TOL = Tolerances(reported_capacity=0.01, rejection_point=1.0, rejection_point_relative=0.05, usage_gap=0.05)


def figures(**changes) -> dict:
    """One release's figures as kvprobe.probe.diff.release_figures writes them: vLLM 0.33 on a pool of 201."""
    base = {"version": "0.33.0", "startup": "started", "refusal": None, "ledger_startup": "starts",
            "policy": "vllm-0.33", "rule": "whole prompt must fit from 0.19", "async_scheduling": True,
            "pool_unit": "blocks", "pool": 201, "ledger_pool": 201, "predicted": 3.9, "predicted_binding": "kv",
            "predicted_usage": 0.759, "rejection_point": 4.0, "uncertainty": 0.05, "deep_levels": [7, 9],
            "preemptions_per_deep_level": 0.0, "preemptions_per_1k_steps": 0.0, "ledger_preemption_rate": 0.0,
            "ledger_preemption_users": 9,
            "usage_at_saturation": 0.76, "binding": "kv", "status": "passed", "reason": "", "artifacts": "x"}
    return base | changes


def changes_between(a: dict, b: dict) -> dict[str, dict]:
    return {c["quantity"]: c for c in find_changes(["A", "B"], {"A": a, "B": b}, TOL)}


def test_the_table_shows_a_reservation_engines_time_average_beside_its_limit():
    # SGLang from 0.5.22 runs at most 21 at once; the measured plateau is judged against its 20.93 average
    old = figures(version="0.5.21", predicted=22.0, predicted_mean=22.0)
    new = figures(version="0.5.23", predicted=21.0, predicted_mean=20.93)
    table = diff_table(SimpleNamespace(versions=["0.5.21", "0.5.23"], results={"0.5.21": old, "0.5.23": new}),
                       title="t")
    row = next(line for line in table.splitlines() if "ledger: admission limit" in line)
    assert "21.00, 20.93 on average (kv binds)" in row
    assert "22.00 (kv binds)" in row and "22.00," not in row  # no average where it is the limit


def test_a_move_the_ledgers_rule_makes_too_is_explained_by_that_rule():
    old = figures(version="0.11.0", policy="vllm-0.11", rule="first chunk", preemptions_per_deep_level=28.5,
                  preemptions_per_1k_steps=61.2, ledger_preemption_rate=77.5, usage_at_saturation=0.86,
                  predicted_usage=0.849)
    found = changes_between(old, figures())
    assert set(found) == {"preemptions per 1k steps", "usage at saturation"}
    for change in found.values():
        assert change["explained"] and change["explanation"] == (
            "explained: vllm-0.11 -> vllm-0.33, whole prompt must fit from 0.19")
    # the measured side in the ledger's unit (per 1k engine steps), not the count per level (28.5)
    assert found["preemptions per 1k steps"]["measured"] == [61.2, 0.0]
    assert found["preemptions per 1k steps"]["ledger"] == [77.5, 0.0]
    assert change_line(found["preemptions per 1k steps"]).startswith(
        "A -> B: preemptions per 1k steps 61.2 -> 0 (ledger 77.5 -> 0); explained")


def test_preemptions_per_1k_steps_come_from_the_levels_steps():
    # 0.18.1's shadow run: 6 and 16 preemptions over ~430 and ~440 steps at the deep levels
    deep = [SimpleNamespace(preemptions=6.0, engine_steps=430.0), SimpleNamespace(preemptions=16.0, engine_steps=440.0)]
    assert _per_1k_steps(11.0, deep) == pytest.approx(1000 * 22 / 870, abs=0.01)
    assert _per_1k_steps(0.0, [SimpleNamespace(preemptions=0.0, engine_steps=None)]) == 0.0  # none in any unit
    # a level whose steps the streams could not time: no rate, but the presence is still compared
    assert _per_1k_steps(6.0, [SimpleNamespace(preemptions=6.0, engine_steps=None)]) is None
    found = changes_between(figures(preemptions_per_deep_level=6.0, preemptions_per_1k_steps=None), figures())
    assert found["preemptions per 1k steps"]["measured"] == [None, 0.0]


def test_a_move_the_ledger_does_not_make_is_unexplained():
    # the engine preempts on the newer release, the ledger predicts no preemption on either
    found = changes_between(figures(), figures(preemptions_per_deep_level=3.0, rejection_point=6.5))
    assert set(found) == {"preemptions per 1k steps", "rejection point"}
    assert all(not c["explained"] and c["explanation"] == UNEXPLAINED for c in found.values())


def test_preemptions_seen_on_one_side_change_only_beyond_chance():
    """0.25.1 -> 0.33.0 on Qwen3-Next's shadow (docs/diff.md): one preemption in each of two deep levels against
    none, where the ledger predicts none on either, was read as a change; SGLang 0.5.21's 2.5 a level against
    0.5.23's none (a rule's change, docs/diff.md) still is."""
    quiet = figures(deep_level_steps=540.0)
    assert changes_between(quiet, figures(preemptions_per_deep_level=1.0, deep_level_steps=520.0)) == {}
    assert changes_between(quiet, figures(preemptions_per_deep_level=2.0, deep_level_steps=530.0)) == {}  # 4: 0.06
    found = changes_between(quiet, figures(preemptions_per_deep_level=2.5, deep_level_steps=530.0))  # 5: 0.03
    assert set(found) == {"preemptions per 1k steps"}
    # exposure weighs the counts: five in a run ten times as long as the quiet one's is what one rate gives
    assert changes_between(figures(deep_level_steps=100.0),
                           figures(preemptions_per_deep_level=2.5, deep_level_steps=1000.0)) == {}
    # without steps, the deep levels are the exposure; 0.18.1's six a level over two levels is far beyond chance
    found = changes_between(figures(preemptions_per_deep_level=6.0), figures())
    assert set(found) == {"preemptions per 1k steps"}
    # a change the ledger predicts needs no more than the measurement agreeing: two retractions against none
    found = changes_between(figures(preemptions_per_deep_level=1.0, ledger_preemption_rate=3.91), quiet)
    assert found["preemptions per 1k steps"]["explained"]
    # both preempting is one state, whatever the rates (those are the table's to show)
    assert changes_between(figures(preemptions_per_deep_level=1.0), figures(preemptions_per_deep_level=40.0)) == {}


def test_a_move_within_tolerance_or_within_the_uncertainties_is_no_change():
    assert changes_between(figures(), figures(rejection_point=4.9, usage_at_saturation=0.8, pool=202)) == {}
    # 1.5 apart, but the two plateaus' uncertainties (hypot 0.6) leave less than the ±1 tolerance
    assert changes_between(figures(uncertainty=0.5), figures(rejection_point=5.5, uncertainty=0.35)) == {}
    # what a release did not measure is not compared (a SGLang counter absent is counted as 0 before this)
    assert changes_between(figures(), figures(preemptions_per_deep_level=None, binding="unknown")) == {}


def test_a_pool_moved_by_the_release_budget_is_explained_without_a_policy_change():
    found = changes_between(figures(pool=201, ledger_pool=201), figures(pool=240, ledger_pool=240))
    assert found["pool"]["explained"] and "admission rule vllm-0.33 on both" in found["pool"]["explanation"]


def _sglang_budget_figures(version: str, **inputs) -> dict:
    """The memory figures the diff keeps from the ledger of SGLang `version` on a declared 24 GiB card."""
    ledger = build_ledger(LedgerInputs(engine="sglang", engine_version=version, model="meta-llama/Llama-3.1-8B",
                                       gpu_memory_bytes=24 * 2**30, context_length=2048, **inputs))
    budget = ledger.to_dict()["budget"]
    return {"pool": budget["max_total_num_tokens"], "ledger_pool": budget["max_total_num_tokens"],
            "memory": memory_figures(budget)}


def test_a_pool_moved_by_the_memory_rules_names_them_and_what_they_set():
    # 0.5.19 -> 0.5.20 on a 24 GiB card: the 20-35 GiB tier's defaults move, so the default fraction does
    old = figures(policy="sglang-0.5.21", **_sglang_budget_figures("0.5.19"))
    new = figures(policy="sglang-0.5.21", **_sglang_budget_figures("0.5.20"), rejection_point=2.0, predicted=2.1)
    found = changes_between(old, new)
    assert found["pool"]["explained"] and found["pool"]["explanation"] == (
        "explained: memory rules SGLang 0.5.10 rules (read 0.5.10 to 0.5.19) -> SGLang 0.5.20 rules (read 0.5.20 to "
        "0.5.21), the 20-35 GiB tier's chunked prefill 2048 -> 4096 and cuda-graph bs 24 -> 48 (tp < 4), so a larger "
        "reserve, and 0.95 without a GPU, from 0.5.20 (the ledger's mem_fraction_static 0.833 -> 0.704, chunked "
        "prefill 2048 -> 4096, cuda-graph bs 24 -> 48)")
    # the plateau moved with the pool: the same rules named, no admission policy changed
    assert found["rejection point"]["explanation"] == found["pool"]["explanation"]


def test_a_pool_change_at_a_policy_boundary_is_not_put_down_to_the_policy():
    # 0.5.21 -> 0.5.22 with --max-running-requests 8: the decode graph bs (and its reserve) lowered; the
    # ignore_eos reservation changes at the same release, and moves the plateau, not the pool
    old = figures(policy="sglang-0.5.21", rule="at new_token_ratio", **_sglang_budget_figures(
        "0.5.21", max_running_requests=8))
    new = figures(policy="sglang-0.5.22", rule="in full from 0.5.22", rejection_point=6.0, predicted=6.1,
                  **_sglang_budget_figures("0.5.22", max_running_requests=8))
    assert new["pool"] > old["pool"]
    found = changes_between(old, new)
    pool = found["pool"]["explanation"]
    assert "cuda-graph bs 48 -> 8" in pool and "lowered to it" in pool and "sglang-0.5.22" not in pool
    assert found["rejection point"]["explanation"] == (
        f"{pool}; and sglang-0.5.21 -> sglang-0.5.22, in full from 0.5.22")


def _window_line_figures(version: str, logged: int, blocks: int = 400, max_num_seqs: int = 16,
                         prompt_tokens: int = 1000) -> dict:
    """vLLM `version` on expectations/diff/vllm-hybrid-window-shadow.yaml's shape (gpt-oss-20b, 400 blocks
    of 16, 512-token steps; vllm-window-cap-shadow.yaml's with 700, 32, 1500): what the diff keeps of the
    ledger's capacity line, limit and release rules, and the line the release's own shadow logged
    (`logged`, read off the 2026-12-07 runs), with async scheduling (their default)."""
    ledger = build_ledger(LedgerInputs(engine="vllm", engine_version=version, model="openai/gpt-oss-20b",
                                       num_gpu_blocks_override=blocks, block_size=16, max_model_len=4096,
                                       max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                       prompt_tokens=prompt_tokens, output_tokens=200,
                                       async_scheduling=True)).to_dict()
    limit = ledger["admission"]["limit"]
    return figures(version=version, pool=blocks, ledger_pool=blocks, claim_tokens=logged,
                   ledger_claim_tokens=ledger["capacity"]["kv_tokens"], predicted=limit, rejection_point=limit,
                   release_rules={r["aspect"]: r["rule"] for r in ledger["release_rules"]})


def test_a_capacity_line_that_moved_without_its_pool_is_named_with_the_window_rule():
    # vLLM 0.26.0 counts async scheduling's second batch in flight for a window group (W - 1 + 2T, 73
    # blocks a request, against 0.25.1's 41): the same 400 blocks log 4,979 tokens where 0.25.1 logged 5,516
    old, new = _window_line_figures("0.25.1", 5516), _window_line_figures("0.26.0", 4979)
    assert (old["ledger_claim_tokens"], new["ledger_claim_tokens"]) == (5516, 4979)
    found = changes_between(old, new)
    assert set(found) == {"engine's capacity line (tokens)"}
    line = found["engine's capacity line (tokens)"]
    assert line["explained"] and line["measured"] == [5516, 4979] and line["ledger"] == [5516, 4979]
    assert "window blocks in flight: W-1+2T" in line["explanation"]
    assert "window admission" not in line["explanation"]  # capped on both (0.20.0 on)
    assert "KV cache size figure" not in line["explanation"]  # the same line semantics on both (0.20.1 on)


def test_the_window_cap_pair_names_the_cap_for_the_plateau_and_the_line_rule_for_the_capacity_line():
    # vLLM 0.19.1 charges a window group the whole prompt in its full-sequence check (94 blocks for 1,500
    # tokens), 0.20.2 its cap (41): a fifth more running on the same 700 blocks; and the capacity line's
    # semantics moved at 0.20.1 (groups' share of the pool -> max_concurrency x max_model_len)
    old = _window_line_figures("0.19.1", 5600, blocks=700, max_num_seqs=32, prompt_tokens=1500)
    new = _window_line_figures("0.20.2", 9653, blocks=700, max_num_seqs=32, prompt_tokens=1500)
    assert (old["ledger_claim_tokens"], new["ledger_claim_tokens"]) == (5600, 9653)
    assert 1.1 < new["predicted"] / old["predicted"] < 1.3
    tol = Tolerances(rejection_point=0.5)  # the pair's own: a request apart is the change
    found = {c["quantity"]: c for c in find_changes(["A", "B"], {"A": old, "B": new}, tol)}
    assert set(found) == {"rejection point", "engine's capacity line (tokens)"}
    assert found["rejection point"]["explanation"] == (
        "explained: window admission: window groups capped in the full-sequence check (from 0.20.0)")
    line = found["engine's capacity line (tokens)"]["explanation"]
    assert "KV cache size figure" in line and "window" not in line  # the in-flight rule is 0.25.1's on both


def test_a_capacity_line_is_not_put_down_to_the_admission_policy():
    # 0.18.1 -> 0.33.0 on the hybrid pair: first-chunk against whole-prompt admission, which moves no line
    old = {**_window_line_figures("0.18.1", 3200), "policy": "vllm-0.11", "rule": "first chunk"}
    new = _window_line_figures("0.33.0", 4979)
    found = changes_between(old, new)
    line = found["engine's capacity line (tokens)"]["explanation"]
    assert "KV cache size figure" in line and "window blocks in flight" in line and "vllm-0.11" not in line
    assert "hybrid block pool" not in line  # moves admission, not the line


def test_a_capacity_line_that_follows_its_pool_is_no_change_of_its_own():
    # the pool grew by a fifth and the line with it: one change, the pool's
    found = changes_between(figures(claim_tokens=3216, ledger_claim_tokens=3216),
                            figures(pool=241, ledger_pool=241, claim_tokens=3856, ledger_claim_tokens=3856))
    assert set(found) == {"pool"}
    # a line that moved where the ledger's did not: unexplained
    found = changes_between(figures(claim_tokens=3216, ledger_claim_tokens=3216),
                            figures(claim_tokens=2800, ledger_claim_tokens=3216))
    assert found["engine's capacity line (tokens)"]["explanation"] == UNEXPLAINED


def test_a_pool_moved_by_the_default_block_size_names_that_rule():
    # vLLM 0.34.0 takes 64-token blocks where 0.33.0 took 16 (config/cache.py L185): the same override of
    # 201 blocks holds four times the tokens, and the plateau moves with it
    def rules(version):
        led = build_ledger(LedgerInputs(engine="vllm", engine_version=version, model="meta-llama/Llama-3.1-8B",
                                        num_gpu_blocks_override=201, max_model_len=2048, prompt_tokens=512,
                                        output_tokens=256, async_scheduling=True)).to_dict()
        return {r["aspect"]: r["rule"] for r in led["release_rules"]}, led["admission"]["limit"]
    (old_rules, old_limit), (new_rules, new_limit) = rules("0.33.0"), rules("0.34.0")
    assert new_limit > 3 * old_limit
    found = changes_between(figures(release_rules=old_rules, predicted=old_limit),
                            figures(version="0.34.0", release_rules=new_rules, predicted=new_limit,
                                    rejection_point=new_limit))
    assert found["rejection point"]["explained"]
    assert "block size: 64 tokens, this release's default" in found["rejection point"]["explanation"]


def test_a_hybrids_block_size_published_by_each_release_is_named_as_the_default_raised_for_its_state():
    # Qwen3-Next (Gated DeltaNet + full attention): its block is the default raised until an attention page
    # holds a Mamba state, 544 on 0.33.0 (from 16) and 576 on 0.34.0 (from 64); each engine publishes its own,
    # which the diff's ledgers take as given: the rule still says whose default it is
    def rules(version, published):
        led = build_ledger(LedgerInputs(engine="vllm", engine_version=version,
                                        model="Qwen/Qwen3-Next-80B-A3B-Instruct", num_gpu_blocks_override=30,
                                        block_size=published, max_model_len=4096, enable_prefix_caching=False,
                                        prompt_tokens=1000, output_tokens=200, async_scheduling=True)).to_dict()
        return {r["aspect"]: r["rule"] for r in led["release_rules"]}
    old, new = rules("0.33.0", 544), rules("0.34.0", 576)
    assert old["block size"].startswith("544 tokens, this release's default 16 ")
    assert new["block size"].startswith("576 tokens, this release's default 64 ")
    assert "holds a Mamba state" in new["block size"]
    found = changes_between(figures(release_rules=old, usage_at_saturation=0.934, predicted_usage=0.948),
                            figures(version="0.34.0", release_rules=new, usage_at_saturation=0.883,
                                    predicted_usage=0.897))
    assert found["usage at saturation"]["explanation"] == f"explained: block size: {new['block size']}"
    assert rules("0.34.0", 1024)["block size"] == "1024 tokens, given"


def test_a_release_that_refuses_is_a_change_of_startup():
    refused = figures(startup="refused", ledger_startup="refused", refusal="To serve at least one request ...",
                      pool=None, rejection_point=None, usage_at_saturation=None, binding=None,
                      preemptions_per_deep_level=None)
    found = changes_between(figures(), refused)
    assert list(found) == ["startup"] and found["startup"]["explained"]


def test_a_start_up_change_is_explained_by_the_refusal_not_the_policy():
    # 0.23.0 -> 0.24.0 with --watermark: the same admission policy on both, the flag is the reason
    refusal = "vLLM 0.23.0 has no --watermark (it came in 0.24.0): vllm: error: unrecognized arguments: --watermark 0.2"
    old = figures(version="0.23.0", startup="refused", ledger_startup="refused", refusal=refusal, pool=None,
                  rejection_point=None, usage_at_saturation=None, binding=None, preemptions_per_deep_level=None)
    found = changes_between(old, figures(version="0.24.0"))
    assert found["startup"]["explanation"] == f"explained: 0.23.0 refuses where 0.24.0 starts: {refusal}"
    assert "vllm-0.33" not in found["startup"]["explanation"]


def test_a_version_given_twice_gets_its_own_label():
    assert labels(["0.33.0", "0.11.0", "0.33.0"]) == ["0.33.0", "0.11.0", "0.33.0#2"]


# -- bad input: refused with one line before anything starts ----------------------------------------


def test_an_unknown_version_is_bad_input_naming_the_known_ones(capsys, tmp_path):
    rc, out, err = run(capsys, "diff", VLLM_PAIR, "--versions", "0.11.0,0.99.0", "--artifacts", str(tmp_path))
    assert rc == 2 and out == ""
    assert "--versions: expected vllm versions kvprobe has facts for (" in err and "0.33.0" in err
    assert "got '0.99.0'" in err
    assert not any(tmp_path.iterdir())  # nothing launched, nothing written


@pytest.mark.parametrize("versions", ["0.33.0", "0.33.0,", ""])
def test_fewer_than_two_versions_is_bad_input(capsys, versions):
    rc, _, err = run(capsys, "diff", VLLM_PAIR, "--versions", versions)
    assert rc == 2 and "expected two or more comma-separated versions" in err


def test_an_expectation_with_its_own_policy_is_bad_input(capsys, tmp_path):
    doc = yaml.safe_load(Path(VLLM_PAIR).read_text()) | {"policy": "vllm-0.33"}
    path = tmp_path / "pinned.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, _, err = run(capsys, "diff", str(path), "--versions", "0.11.0,0.33.0", "--artifacts", str(tmp_path / "a"))
    assert rc == 2 and f"{path}: policy: expected no `policy:`" in err


def test_a_shadow_release_without_its_environment_names_the_install_command(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "empty-cache"))
    shadow = str(REPO / "expectations" / "shadow-vllm.yaml")
    rc, _, err = run(capsys, "diff", shadow, "--versions", "0.33.0,0.33.0", "--artifacts", str(tmp_path / "a"))
    assert rc == 3 and "run `kvprobe shadow install vllm==0.33.0`, or give --install" in err
    rc, _, err = run(capsys, "diff", shadow, "--versions", "0.11.0,0.33.0", "--artifacts", str(tmp_path / "a"))
    assert rc == 2 and "a release with a shadow engine environment" in err and "vllm==0.33.0" in err


# -- end to end on the emulator -----------------------------------------------------------------


@pytest.mark.slow
def test_vllm_first_chunk_against_whole_prompt_admission_is_found_and_named(capsys, tmp_path):
    rc, out, err = run(capsys, "diff", VLLM_PAIR, "--versions", "0.11.0,0.33.0", "--artifacts", str(tmp_path))
    assert rc == 1, out + err
    doc = json.loads((tmp_path / "diff.json").read_text())
    assert doc["versions"] == ["0.11.0", "0.33.0"]
    old, new = doc["results"]["0.11.0"], doc["results"]["0.33.0"]
    assert (old["policy"], new["policy"]) == ("vllm-0.11", "vllm-0.33")
    assert old["preemptions_per_deep_level"] > 0 and new["preemptions_per_deep_level"] == 0
    # the measured side in the ledger's unit: the streams timed the steps
    assert old["preemptions_per_1k_steps"] > 0 and new["preemptions_per_1k_steps"] == 0
    assert "/1k steps" in out.split("preemptions (measured)")[1].splitlines()[0]
    assert old["pool"] == new["pool"] == 201
    assert old["engine_claim"]["tokens"] == 201 * 16  # 0.11's capacity line: num_gpu_blocks x block_size
    assert "engine's capacity line" in out and new["engine_claim"]["requests"] > 0
    found = {c["quantity"]: c for c in doc["changes"]}
    assert found["preemptions per 1k steps"]["explained"]
    rule = "explained: vllm-0.11 -> vllm-0.33, whole prompt must fit from 0.19"
    assert found["preemptions per 1k steps"]["explanation"].startswith(rule)
    assert "pool" not in found and "startup" not in found
    assert "changes:" in out and "0.11.0 -> 0.33.0: preemptions per 1k steps" in out
    assert (tmp_path / "0.11.0" / "result.json").is_file() and (tmp_path / "0.33.0" / "result.json").is_file()
    assert (tmp_path / "diff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot per release


@pytest.mark.slow
def test_sglang_ignore_eos_reservation_is_found_and_named(capsys, tmp_path):
    rc, out, err = run(capsys, "diff", SGLANG_PAIR, "--versions", "0.5.21,0.5.23", "--json",
                       "--artifacts", str(tmp_path))
    assert rc == 1, out + err
    doc = json.loads(out)  # --json: the document alone on stdout, the probes' progress on stderr
    assert doc == json.loads((tmp_path / "diff.json").read_text())
    old, new = doc["results"]["0.5.21"], doc["results"]["0.5.23"]
    assert (old["policy"], new["policy"]) == ("sglang-0.5.21", "sglang-0.5.22")
    assert old["preemptions_per_deep_level"] > 0 and new["preemptions_per_deep_level"] == 0
    found = {c["quantity"]: c for c in doc["changes"]}
    change = found["preemptions per 1k steps"]
    # the admission policy, then the scheduler loop that changed between them (both its rules: 0.5.22, 0.5.23)
    assert change["explained"] and change["explanation"] == (
        "explained: sglang-0.5.21 -> sglang-0.5.22, an ignore_eos request's output reserved in full (ratio 1.0) "
        "from 0.5.22; and scheduler loop: " + scheduler_rule_text("0.5.23"))
    assert new["scheduler_loop"] == scheduler_rule_text("0.5.23")
    assert new["rejection_point"] == pytest.approx(11, abs=1) and old["rejection_point"] > new["rejection_point"]


@pytest.mark.slow
# Two runs of one emulated release must agree within the tolerances, so a level's dip on a loaded machine is a
# change: a clean clone's second run held 3.71 running at N=8 (usage 69.4% against 76.5%) while the other lane
# started engines. It runs while the other lane starts none (tests/conftest.py).
@pytest.mark.needs_a_quiet_machine
def test_the_same_release_twice_changes_nothing(capsys, tmp_path):
    # the vLLM pair's shape: its requests live ~10x shorter than the SGLang pair's (O=32 against 256)
    rc, out, err = run(capsys, "diff", VLLM_PAIR, "--versions", "0.33.0,0.33.0", "--artifacts", str(tmp_path))
    assert rc == 0, out + err
    doc = json.loads((tmp_path / "diff.json").read_text())
    assert doc["versions"] == ["0.33.0", "0.33.0#2"] and doc["changes"] == []
    assert "changes: none beyond the expectation's tolerances" in out
    assert (tmp_path / "0.33.0#2" / "result.json").is_file()
