"""Probes of the real vLLM 0.33.0 serving stack (`launch: shadow`), through `kvprobe probe` and
through `pytest --kvprobe`, on the shipped shadow expectations. Every verdict must pass with the
default tolerances; the measured figures go to the terminal as each probe ends, and no process of
the engine (API server, EngineCore) may outlive its probe.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvprobe.errors import TargetError
from kvprobe.procgroup import free_port
from kvprobe.spec.expectation import load_expectations
from tests.shadow.conftest import REPO, alive, engine_pids

pytestmark = pytest.mark.slow
EXPECTATIONS = REPO / "expectations"


def run_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvprobe", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, start_new_session=True)


def run_cli_side_by_side(runs: list[list[str]], timeout: float) -> list[subprocess.CompletedProcess]:
    """`kvprobe ARGS` for each of `runs`, all started at once; their results in the same order."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda args: run_cli(args, timeout), runs))


def verdict_lines(stdout: str) -> str:
    """The per-level table and the verdict table, as `kvprobe probe` printed them."""
    keep = [ln for ln in stdout.splitlines() if ln.startswith(("  users", "check ", "------", "verdict:"))
            or " PASS " in ln or " FAIL " in ln]
    return "\n".join(keep)


def assert_engine_gone(artifacts: Path) -> None:
    pids = engine_pids(artifacts / "engine.log")
    assert len(pids) >= 2, "the log names the API server and the EngineCore"
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"engine processes left behind: {pids}"


# The shapes of requests under a second (P+O <= 544 at 10 ms steps): their client lag limit is the
# floor of 15 ms, and the real API server, slowed by another lane's engine starting, streams in bursts
# that lag Locust's loop past it (21.4 ms at N=41 of prefix-caching, with that client 5 nice levels
# up). They run on a quiet machine (tests/conftest.py). `shadow-vllm-kv-cache-memory-bytes` and
# `shadow-vllm-gpu-memory-utilization` run in `make matrix` only: their pools are vLLM's own planner's
# (test_vllm_planner.py `kv-bytes`, `gpu-24GiB-util-0.7`), their admission shadow-vllm.yaml's, and a probe
# on a quiet machine costs the suite its whole wall clock (CI ran it in 28 minutes with the second one here).
QUIET = pytest.mark.needs_a_quiet_machine
CLI_PROBES = [
    pytest.param("shadow-vllm.yaml", None, id="shadow-vllm.yaml"),
    pytest.param("shadow-vllm-shapes.yaml", "shadow-vllm-long-output", id="shadow-vllm-long-output"),
    *(pytest.param("shadow-vllm-shapes.yaml", name, id=name, marks=QUIET)
      for name in ("shadow-vllm-mla", "shadow-vllm-prefix-caching")),
]


@pytest.mark.parametrize(("file", "name"), CLI_PROBES)
def test_kvprobe_probe_passes_against_real_vllm(vllm_env, tmp_path, say, file, name):
    args = ["probe", str(EXPECTATIONS / file), "--artifacts", str(tmp_path)] + (["--name", name] if name else [])
    t0 = time.monotonic()
    out = run_cli(args, timeout=400)
    say(f"\n--- kvprobe probe {file}{' --name ' + name if name else ''} ({time.monotonic() - t0:.0f} s)\n"
        + verdict_lines(out.stdout))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["verdict"]["passed"]
    shadow = result["engine_facts"]["shadow"]
    # the probe records which scheduler ran: async scheduling on, as on a CUDA GPU
    assert shadow["scheduler"] == "AsyncScheduler" and shadow["async_scheduling"] is True
    if name == "shadow-vllm-mla":  # the GPU's MLA choices, put back over the CPU platform's
        assert shadow["block_size"] == 64 and result["engine_facts"]["reported"]["block_size"] == 64
        restored = {"enable_chunked_prefill False -> True", "enable_prefix_caching False -> True"}
        assert restored <= set(shadow["restored"])
    assert_engine_gone(tmp_path)


def test_pytest_kvprobe_passes_against_real_vllm(vllm_env, pytester, say):
    """The same expectation file collected by the pytest plugin: one item per check, all passing."""
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider\n")
    shapes = load_expectations(EXPECTATIONS / "shadow-vllm-shapes.yaml")
    exp = next(e for e in shapes if e.name == "shadow-vllm-max-num-seqs")
    (pytester.path / "expectations").mkdir()
    src = (EXPECTATIONS / "shadow-vllm-shapes.yaml").read_text()
    (pytester.path / "expectations" / "shapes.yaml").write_text(src)
    t0 = time.monotonic()
    result = pytester.runpytest_subprocess("--kvprobe", "-k", "max-num-seqs", "-rA",
                                           "--kvprobe-artifacts", str(pytester.path / "art"), timeout=400)
    out = result.stdout.str()
    summary = out[out.find("kvprobe summary"):] if "kvprobe summary" in out else out[-2000:]
    say(f"\n--- pytest --kvprobe -k max-num-seqs ({time.monotonic() - t0:.0f} s)\n{summary}")
    result.assert_outcomes(passed=len(exp.checks))
    assert_engine_gone(pytester.path / "art" / exp.name)


def test_a_vllm_refusal_is_one_line_with_the_log_tail(vllm_env, tmp_path):
    """vLLM's own start-up refusal (a max_model_len the pool cannot hold): the launcher's error is one
    line, vLLM's message is in the log tail, the time is bounded and no process is left."""
    from kvprobe.targets.shadow.target import open_shadow

    (tmp_path / "e.yaml").write_text(json.dumps({
        "name": "refused", "engine": "vllm", "version": "0.33.0", "model": "meta-llama/Llama-3.1-8B",
        "flags": {"num-gpu-blocks-override": 100, "block-size": 16, "max-model-len": 4096},
        "target": {"launch": "shadow", "startup_timeout": 120},
        "profile": {"request": {"prompt_tokens": 128, "output_tokens": 32},
                    "ramp": {"strategy": "explicit", "levels": [1]}, "hold": {"seconds": 1}}}))
    exp = load_expectations(tmp_path / "e.yaml")[0]
    t0 = time.monotonic()
    with pytest.raises(TargetError) as err:
        open_shadow(exp, port=free_port(), log_path=tmp_path / "engine.log")
    first = str(err.value).splitlines()[0]
    # the one line carries vLLM's own reason, which the log's last lines only echo
    assert first.startswith("vllm exited with code 1 during start-up"), first
    assert "the engine refused: ValueError: To serve at least one request with the model's max seq len (4096)" in first
    assert "Engine core initialization failed" in err.value.log_tail
    assert time.monotonic() - t0 < 120
    assert_engine_gone(tmp_path)



def test_no_scheduler_reserve_full_isl_brings_back_over_admission(vllm_env, tmp_path, say):
    """A real behaviour of vLLM 0.33's code: with full-ISL admission (the default) P=3000 over a
    2048-token budget never preempts, even with requests waiting; without it (0.11's first-chunk
    admission) the over-admitted requests preempt others at every saturated level — which the ledger
    predicts when the flag is declared, and which fails no_preemption when it is not."""
    names = ("shadow-vllm-full-isl", "shadow-vllm-overadmission", "shadow-vllm-overadmission-undeclared")
    # The three probes run side by side (each its own server, as the file's run would start them one
    # after another): their engines mostly wait on the modelled steps. Each must exit 0, as the
    # file's run must (expect_fail: no_preemption is what the undeclared one expects).
    t0 = time.monotonic()
    outs = run_cli_side_by_side(
        [["probe", str(EXPECTATIONS / "shadow-vllm-overadmission.yaml"), "--name", name,
          "--artifacts", str(tmp_path / name)] for name in names], timeout=600)
    for name, out in zip(names, outs, strict=True):
        say(f"\n--- kvprobe probe shadow-vllm-overadmission.yaml --name {name} ({time.monotonic() - t0:.0f} s, "
            f"side by side)\n" + verdict_lines(out.stdout))
    for out in outs:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    docs = {name: json.loads((tmp_path / name / "result.json").read_text()) for name in names}
    full, over, undeclared = (docs[name]["levels"] for name in names)
    assert sum(lv["preemptions"] for lv in full) == 0, full
    for levels in (over, undeclared):  # the flag, declared or not, is what the engine does
        saturated = [lv for lv in levels if lv["users"] > 10]  # above floor(1999 / 192): requests wait
        assert saturated and all(lv["preemptions"] > 0 for lv in saturated), levels
        assert all(lv["preemptions"] == 0 for lv in levels if lv["users"] <= 10), levels
    # not declared, the flag's preemptions fail no_preemption, naming where: the ledger's policy
    # (full-ISL admission) preempts nothing at those levels
    checks = {c["name"]: c for c in docs["shadow-vllm-overadmission-undeclared"]["checks"]}
    assert checks["no_preemption"]["passed"] is False, checks["no_preemption"]
    assert "the engine preempted at N=14" in checks["no_preemption"]["reason"], checks["no_preemption"]
    assert "vllm-0.33" in checks["no_preemption"]["reason"]
    assert checks["rejection_point"]["passed"] is True  # the plateau alone cannot tell
    for name in ("shadow-vllm-full-isl", "shadow-vllm-overadmission"):  # declared: the policy predicts what happens
        assert {c["name"]: c["passed"] for c in docs[name]["checks"]}["no_preemption"] is True
    for name in names:
        assert_engine_gone(tmp_path / name)


def test_kvprobe_shadow_vllm_serves_on_the_console(vllm_env, tmp_path, console_tmpdir):
    """`kvprobe shadow vllm MODEL [vllm serve flags]`: the real server under the preset's name, its pool
    from the passed-through flag, stopped with its process group."""
    from kvprobe.observe.http import http_get
    from kvprobe.targets.launch import Target

    port = free_port()
    argv = [sys.executable, "-m", "kvprobe", "shadow", "vllm", "meta-llama/Llama-3.1-8B", "--port", str(port),
            "--step-ms", "20", "--num-gpu-blocks-override", "300", "--max-model-len", "2048", "--enforce-eager"]
    env = console_tmpdir
    with Target.launch(argv, engine="vllm", port=port, log_path=str(tmp_path / "engine.log"),
                       startup_timeout=300, env=env) as target:
        # vLLM's sockets in the test's own temporary folder, not the machine's /tmp
        assert [p for p in Path(env["TMPDIR"]).iterdir() if p.is_socket()], env
        status, body = http_get(target.url + "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "meta-llama/Llama-3.1-8B"
        facts = target.facts()
        assert facts.reported.num_blocks == 300 and facts.reported.max_model_len == 2048
        # an attached probe naming the other engine is stopped by vLLM's own signs (tests/cli/test_wrong_engine.py)
        from kvprobe.errors import ConfigError
        from kvprobe.observe.discovery import check_engine, engine_signs

        signs = engine_signs(target.url)
        assert signs == {"vllm": ["/metrics has vllm: families", "/v1/models says owned_by 'vllm'",
                                  "/version answers (vLLM's)"], "sglang": []}
        with pytest.raises(ConfigError, match=r"looks like vllm, not sglang .*: probe it with --engine vllm$"):
            check_engine(target.url, "sglang")
        check_engine(target.url, "vllm")
    assert_engine_gone(tmp_path)
