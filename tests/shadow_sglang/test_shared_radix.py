"""`kvprobe shadow sglang` on the console (M=16,384, context 8192, radix cache on), shared by:
`pytest --kvprobe` on the long-output shape (3 running), a closed loop without ignore_eos that makes
SGLang retract, and the process groups — every SGLang process in the one the console launched, all of
them gone after SIGTERM to the console."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from kvprobe.engines import sglang as dialect
from kvprobe.engines.base import render_flags
from kvprobe.procgroup import free_port, group_members, signal_own_group

from .closed_loop import closed_loop
from .conftest import STARTUP_TIMEOUT, Server, shipped
from .probes import report, run_pytest_kvprobe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a probe of a long shape runs 2-5 min here
SERVER = "shadow-sglang-long"  # the flags and time model of this module's server
_READY = re.compile(r"SGLang ready at (http://\S+) as .* \(process group (\d+)\)")


def _console_argv(exp, port: int, log) -> list[str]:
    tm = exp.target.time_model
    return [sys.executable, "-m", "kvprobe", "shadow", "sglang", "--model-path", exp.model, "--port", str(port),
            "--log", str(log), "--step-ms", str(tm["step_ms"]),
            "--prefill-us-per-token", str(tm["prefill_us_per_token"]),
            "--decode-us-per-seq", str(tm["decode_us_per_seq"]), *render_flags(exp.flags, dialect.FLAGS)]


@pytest.fixture(scope="module")
def console(sglang_env, tmp_path_factory):
    """The console command in its own process group, until 'ready'; SIGTERM at the end."""
    exp = shipped(SERVER)
    tmp = tmp_path_factory.mktemp("sglang-console")
    out_path = tmp / "console.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(_console_argv(exp, free_port(), tmp / "engine.log"), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    ready = None
    while ready is None and proc.poll() is None and time.monotonic() < deadline:
        ready = _READY.search(out_path.read_text())
        time.sleep(0.2)
    try:
        assert ready, f"kvprobe shadow sglang did not get ready (rc {proc.poll()}):\n{out_path.read_text()[-3000:]}"
        server = Server(exp, url=ready.group(1), pgid=int(ready.group(2)), log_path=str(tmp / "engine.log"))
        yield server, proc, out_path
    finally:
        signal_own_group(proc, signal.SIGTERM)  # the console's own group: it takes Ctrl-C's path
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            signal_own_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, out_path.read_text()[-3000:]
    assert "kvprobe shadow: stopping" in out_path.read_text()
    assert group_members(server.pgid) == [] and group_members(proc.pid) == []


def test_every_sglang_process_is_in_the_group_the_console_launched(console):
    server, proc, _ = console
    members = group_members(server.pgid)
    # launcher (the group's leader), scheduler, detokenizer, multiprocessing's resource tracker
    assert server.pgid in members and len(members) >= 3, members
    assert server.pgid != proc.pid  # the engine has a group of its own, apart from the console's


def test_pytest_kvprobe_long_output_radix_on_runs_3(console, pytester, tmp_path, figures):
    server, _, _ = console
    result, docs = run_pytest_kvprobe(pytester, server, [SERVER], tmp_path / "art")
    doc = docs[SERVER]
    report(figures, "pytest --kvprobe, on `kvprobe shadow sglang`", SERVER, doc)
    print(result.stdout.str())
    result.assert_outcomes(passed=len(doc["checks"]))
    assert doc["verdict"]["passed"] is True


def test_without_ignore_eos_sglang_retracts_and_the_metrics_show_it(console, figures):
    """40 users, P=512, O=256, plain max_tokens: SGLang admits on new_token_ratio, fills the pool and
    retracts (shadow-engines.md: 22-23 running). Retracted requests keep their output and finish."""
    server, _, _ = console
    counter = dialect.METRICS.preemptions  # sglang:num_retracted_requests (a counter: ..._total)

    def retracted() -> float:
        samples = server.metrics().get(counter) or []  # absent until the first retraction
        return sum(s.value for s in samples if s.name.endswith("_total"))

    before = retracted()
    loop = closed_loop(server.url, model=server.exp.model, users=40, prompt_tokens=512, output_tokens=256,
                       seconds=90, max_requests=3000, stop_when=lambda: retracted() - before >= 5)
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
