"""One real SGLang 0.5.23 shadow (M=16,384, context 8192, radix cache on) shared by: `pytest --kvprobe`
on the long-output shape (3 running), a closed loop without ignore_eos that makes SGLang retract,
and the process group's membership."""

from __future__ import annotations

import pytest

from kvprobe.engines import sglang as dialect
from kvprobe.procgroup import group_members

from .closed_loop import closed_loop
from .probes import report, run_pytest_kvprobe

pytestmark = pytest.mark.slow
SERVER = "shadow-sglang-long"  # the flags and time model of this module's server


def test_sglang_processes_are_all_in_the_launched_group(shadow_server):
    server = shadow_server(SERVER)
    members = group_members(server.target.pgid)
    # launcher (the group leader), scheduler, detokenizer, multiprocessing's resource tracker
    assert server.target.pid in members and len(members) >= 3, members


def test_pytest_kvprobe_long_output_radix_on_runs_3(shadow_server, pytester, tmp_path, figures):
    server = shadow_server(SERVER)
    result, docs = run_pytest_kvprobe(pytester, server, [SERVER], tmp_path / "art")
    doc = docs[SERVER]
    report(figures, "pytest --kvprobe, shared server", SERVER, doc)
    print(result.stdout.str())
    result.assert_outcomes(passed=len(doc["checks"]))
    assert doc["verdict"]["passed"] is True


def test_without_ignore_eos_sglang_retracts_and_the_metrics_show_it(shadow_server, figures):
    """40 users, P=512, O=256, plain max_tokens: SGLang admits on new_token_ratio, fills the pool and
    retracts (shadow-engines.md: 22-23 running). Retracted requests keep their output and finish."""
    server = shadow_server(SERVER)
    counter = dialect.METRICS.preemptions  # sglang:num_retracted_requests (a counter: ..._total)

    def retracted() -> float:
        samples = server.metrics().get(counter) or []
        return sum(s.value for s in samples if s.name.endswith("_total"))

    before = retracted()
    loop = closed_loop(server.url, model=server.exp.model, users=40, prompt_tokens=512, output_tokens=256,
                       seconds=60, max_requests=2000, stop_when=lambda: retracted() - before >= 5)
    after = retracted()
    retract_lines = server.log().count(dialect.RETRACT_LOG)
    figures(f"no ignore_eos, 40 users P=512 O=256 on M=16384: {len(loop.completion_tokens)} requests in "
            f"{loop.seconds:.1f} s, {after - before:g} retractions ({counter}_total), {retract_lines} "
            f"'{dialect.RETRACT_LOG}' log lines")
    assert loop.errors == []
    assert after - before >= 1 and retract_lines >= 1
    # a retracted request keeps its output and is re-admitted: every one still returns exactly O tokens
    assert loop.completion_tokens and set(loop.completion_tokens) == {256}
    # SGLang's own idle pool check (strict by default) finds no leak after the retractions
    assert dialect.LEAK_LOG not in server.log()
