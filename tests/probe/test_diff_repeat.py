"""`kvprobe diff --repeat N`: each release run N times in a row. A change must show between every run of one
release and every run of the next; what moves between one release's own runs is its noise, printed, not a
change. The figures are the ones two real shadow runs of one pair printed (docs/diff.md, the A100 pair)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import kvprobe.probe.diff as diff
from kvprobe.probe.diff import labels
from kvprobe.probe.diff_changes import UNEXPLAINED, find_changes, find_noise, release_groups
from kvprobe.report.diff import change_line, render_diff
from tests.cli.console import run
from tests.probe.test_diff import TOL, VLLM_PAIR, figures

DATA = Path(__file__).resolve().parents[1] / "data" / "diff"

# The Qwen3-Next Mamba cache-mode shape on a declared A100, vLLM 0.32.0 -> 0.33.0, run twice on 2026-12-07 (the
# figures docs/diff.md keeps): the first pair's usage gauges 0.908 and 0.853 (0.32.0 preempting 26.5 times a deep
# level; 0.33.0's count not kept), the second's 0.899 and 0.913 (6.5 and 7.0); the rejection points 6.39 ± 0.22,
# 5.99 ± 0.10, then 6.34 ± 0.24, 6.45 ± 0.23; the ledger 6.13 and 87.8% on both.
A100 = {
    "0.32.0": figures(version="0.32.0", usage_at_saturation=0.908, rejection_point=6.39, uncertainty=0.22,
                      preemptions_per_deep_level=26.5),
    "0.32.0#2": figures(version="0.32.0", usage_at_saturation=0.899, rejection_point=6.34, uncertainty=0.24,
                        preemptions_per_deep_level=6.5),
    "0.33.0": figures(version="0.33.0", usage_at_saturation=0.853, rejection_point=5.99, uncertainty=0.10,
                      preemptions_per_deep_level=None),
    "0.33.0#2": figures(version="0.33.0", usage_at_saturation=0.913, rejection_point=6.45, uncertainty=0.23,
                        preemptions_per_deep_level=7.0),
}
for _r in A100.values():
    _r.update(predicted=6.13, predicted_usage=0.878, preemptions_per_1k_steps=None)


def test_one_run_each_calls_the_gauges_regime_a_change():
    # what the first run printed: "usage at saturation 0.908 -> 0.853, unexplained"
    (change,) = find_changes(["0.32.0", "0.33.0"], A100, TOL)
    assert change["quantity"] == "usage at saturation" and change["explanation"] == UNEXPLAINED
    assert "runs" not in change


def test_two_runs_each_see_that_the_move_is_the_measurements_own_spread():
    runs = ["0.32.0", "0.32.0#2", "0.33.0", "0.33.0#2"]
    assert find_changes(runs, A100, TOL, repeat=2) == []  # 0.908 against 0.913 is no move
    noise = find_noise(runs, A100, TOL, repeat=2)
    # 0.33.0's own runs are 0.06 apart, beyond the usage gap of 0.05: no release move that small is a change
    assert [(n["release"], n["key"], n["measured"]) for n in noise] == [("0.33.0", "usage", [0.853, 0.913])]
    text = render_diff(SimpleNamespace(versions=runs, results=_with_artifacts(A100), changes=[], noise=noise,
                                       repeat=2), SimpleNamespace(name="mamba", engine="vllm", model="Qwen3-Next"))
    assert "0.33.0 (0.33.0, 0.33.0#2): usage at saturation 0.853, 0.913" in text
    assert "changes: none beyond the expectation's tolerances (each seen between every run" in text


def test_a_change_every_pairing_shows_survives_the_repetition():
    # the vLLM 0.11 -> 0.33 first-chunk pair's figures, each release run twice a little apart
    old = dict(policy="vllm-0.11", rule="first chunk", preemptions_per_1k_steps=61.2, ledger_preemption_rate=77.5,
               predicted_usage=0.849)
    results = {"0.11.0": figures(version="0.11.0", preemptions_per_deep_level=28.5, usage_at_saturation=0.86, **old),
               "0.11.0#2": figures(version="0.11.0", preemptions_per_deep_level=24.0, usage_at_saturation=0.87, **old),
               "0.33.0": figures(), "0.33.0#2": figures(usage_at_saturation=0.75)}
    runs = list(results)
    found = {c["key"]: c for c in find_changes(runs, results, TOL, repeat=2)}
    assert set(found) == {"preemptions", "usage"}
    usage = found["usage"]
    assert usage["from"] == "0.11.0" and usage["to"] == "0.33.0" and usage["explained"]
    assert usage["runs"] == [[0.86, 0.87], [0.76, 0.75]]
    assert usage["measured"] == [0.86, 0.76]  # the closest pair: the move every pairing at least makes
    assert change_line(usage).startswith("0.11.0 -> 0.33.0: usage at saturation 0.86, 0.87 -> 0.76, 0.75 (ledger")
    assert find_noise(runs, results, TOL, repeat=2) == []


def test_a_run_that_could_not_measure_a_figure_leaves_the_pairings_that_did():
    results = dict(A100, **{"0.33.0": figures(version="0.33.0", usage_at_saturation=0.84, predicted=6.13),
                            "0.33.0#2": figures(version="0.33.0", usage_at_saturation=None, predicted=6.13)})
    runs = ["0.32.0", "0.32.0#2", "0.33.0", "0.33.0#2"]
    (change,) = [c for c in find_changes(runs, results, TOL, repeat=2) if c["key"] == "usage"]
    assert change["runs"] == [[0.908, 0.899], [0.84, None]]
    assert change["measured"] == [0.899, 0.84]  # 0.059 apart: the closest pair that measured it
    # at 0.853 the pairing with 0.899 (0.046) is within the gap: no change
    results["0.33.0"]["usage_at_saturation"] = 0.853
    assert "usage" not in {c["key"] for c in find_changes(runs, results, TOL, repeat=2)}


def test_the_real_engines_four_runs_of_the_pair_change_nothing_and_make_no_noise():
    # the same pair on the real 0.32.0 and 0.33.0 shadows with --repeat 2 (docs/diff.md): what the CLI wrote
    doc = json.loads((DATA / "vllm-a100-mamba-repeat2.json").read_text())
    runs, results = doc["versions"], doc["results"]
    assert runs == ["0.32.0", "0.32.0#2", "0.33.0", "0.33.0#2"] and doc["repeat"] == 2
    assert find_changes(runs, results, TOL, repeat=2) == doc["changes"] == []
    assert find_noise(runs, results, TOL, repeat=2) == doc["noise"] == []
    # the widest pairing, 0.32.0#2's 0.909 against 0.33.0#2's 0.862, came within 0.003 of the usage gap
    usage = [results[r]["usage_at_saturation"] for r in runs]
    assert 0.045 < max(usage[:2]) - min(usage[2:]) < TOL.usage_gap


def test_runs_split_into_releases_of_repeat_each():
    assert labels(["0.32.0", "0.32.0", "0.33.0", "0.33.0"]) == ["0.32.0", "0.32.0#2", "0.33.0", "0.33.0#2"]
    assert release_groups(["a", "a#2", "b", "b#2"], 2) == [["a", "a#2"], ["b", "b#2"]]
    with pytest.raises(ValueError, match="3 runs do not split into releases of 2"):
        release_groups(["a", "a#2", "b"], 2)


@pytest.mark.parametrize("repeat", ["0", "-1"])
def test_a_repeat_below_one_is_bad_input(capsys, tmp_path, repeat):
    rc, out, err = run(capsys, "diff", VLLM_PAIR, "--versions", "0.11.0,0.33.0", "--repeat", repeat,
                       "--artifacts", str(tmp_path))
    assert rc == 2 and "--repeat" in err and f"got {repeat}" in err, err
    assert not any(tmp_path.iterdir())  # nothing launched, nothing written


def _with_artifacts(results: dict) -> dict:
    return {k: dict(r, artifacts=f"artifacts/{k}") for k, r in results.items()}


def test_the_expectations_repeat_is_the_diffs_unless_the_command_line_says(capsys, tmp_path, monkeypatch):
    # every release's probe replaced by its figures (no engine): what the command runs and writes
    usage = iter([0.86, 0.87, 0.76, 0.75, 0.86, 0.76])
    ran = []

    def probe(exp, options, artifacts):
        ran.append(artifacts.name)
        return figures(version=exp.version, usage_at_saturation=next(usage), artifacts=str(artifacts))

    monkeypatch.setattr(diff, "run_release", probe)
    doc = yaml.safe_load(Path(VLLM_PAIR).read_text())
    path = tmp_path / "pair.yaml"
    path.write_text(yaml.safe_dump(dict(doc, versions=["0.11.0", "0.33.0"], repeat=2), sort_keys=False))
    rc, out, err = run(capsys, "diff", str(path), "--artifacts", str(tmp_path / "a"))
    written = json.loads((tmp_path / "a" / "diff.json").read_text())
    assert ran == ["0.11.0", "0.11.0#2", "0.33.0", "0.33.0#2"] and written["repeat"] == 2
    assert rc == 1 and [c["runs"] for c in written["changes"]] == [[[0.86, 0.87], [0.76, 0.75]]], out + err
    assert "0.11.0 -> 0.33.0: usage at saturation 0.86, 0.87 -> 0.76, 0.75" in out
    ran.clear()
    rc, out, err = run(capsys, "diff", str(path), "--repeat", "1", "--artifacts", str(tmp_path / "b"))
    assert ran == ["0.11.0", "0.33.0"] and rc == 1, out + err
