"""One real SGLang 0.5.23 shadow with --disable-radix-cache and --max-running-requests 8 (M=16,384,
context 8192) shared by `pytest --kvprobe` on two shapes: the long output (SGLang's
add_one_req_ignore_eos path: 4 running) and --max-running-requests binding before KV (8 running)."""

from __future__ import annotations

import pytest

from .conftest import shipped
from .probes import report, run_pytest_kvprobe

pytestmark = pytest.mark.slow
NAMES = ["shadow-sglang-long-no-radix", "shadow-sglang-max-running"]


def test_the_two_expectations_describe_one_server():
    a, b = (shipped(n) for n in NAMES)
    assert a.flags == b.flags and a.target.time_model == b.target.time_model


def test_pytest_kvprobe_no_radix_long_output_and_max_running_requests(shadow_server, pytester, tmp_path, figures):
    server = shadow_server(NAMES[0])
    result, docs = run_pytest_kvprobe(pytester, server, NAMES, tmp_path / "art")
    for name in NAMES:
        report(figures, "pytest --kvprobe, shared server", name, docs[name])
    print(result.stdout.str())
    result.assert_outcomes(passed=sum(len(d["checks"]) for d in docs.values()))
    assert all(d["verdict"]["passed"] for d in docs.values())
