"""A declared GPU sizes the pool, and --max-running-requests binds before KV, on one real SGLang
0.5.23 shadow: the plugin hands SGLang the KV budget a 24 GiB GPU would leave (kvprobe's ledger: its
memory and the model's weights) and SGLang's own configurator turns it into tokens with the
--mem-fraction-static it resolved — so the flag has its effect, as on the GPU."""

from __future__ import annotations

import pytest

from kvprobe.theory.ledger.build import LedgerInputs, build_ledger

from .probes import report, run_pytest_kvprobe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a probe of a long shape runs 2-5 min here
NAME = "shadow-sglang-max-running"  # declared 24 GiB GPU, --mem-fraction-static 0.75, --max-running-requests 8
GIB = 2**30


def _ledger(**changes):
    inputs = dict(engine="sglang", model="meta-llama/Llama-3.1-8B", gpu_memory_bytes=24 * GIB, context_length=2048)
    return build_ledger(LedgerInputs(**{**inputs, **changes})).budget


def test_declared_gpu_and_mem_fraction_static_size_the_pool_as_the_ledger_does(shadow_server, figures):
    server = shadow_server(NAME)
    led, default = _ledger(mem_fraction_static=0.75, max_running_requests=8), _ledger()
    info = server.server_info()
    reported = info["max_total_num_tokens"]
    sizing = server.target.facts().shadow.get("pool_sizing", "")
    figures(f"declared GPU 24 GiB, --mem-fraction-static 0.75: SGLang's pool {reported} tokens, ledger "
            f"{led.max_total_num_tokens} (SGLang's default fraction {default.fraction} would give "
            f"{default.max_total_num_tokens}); plugin: {sizing}")
    assert info["mem_fraction_static"] == 0.75
    assert sizing.startswith("declared GPU free 24.00 GiB") and "mem_fraction_static 0.75" in sizing
    assert reported == led.max_total_num_tokens != default.max_total_num_tokens
    assert server.gauge("pool_tokens") == reported


def test_pytest_kvprobe_max_running_requests_binds_before_kv(shadow_server, pytester, tmp_path, figures):
    server = shadow_server(NAME)
    result, docs = run_pytest_kvprobe(pytester, server, [NAME], tmp_path / "art")
    report(figures, "pytest --kvprobe, shared server", NAME, docs[NAME])
    print(result.stdout.str())
    result.assert_outcomes(passed=len(docs[NAME]["checks"]))
    assert docs[NAME]["verdict"]["passed"] is True
