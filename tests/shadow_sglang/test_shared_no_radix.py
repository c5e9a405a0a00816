"""`pytest --kvprobe` on a real SGLang 0.5.23 shadow with --disable-radix-cache (M=16,384, context
8192): the long output takes SGLang's add_one_req_ignore_eos path and runs 4 (3 with the cache)."""

from __future__ import annotations

import pytest

from .probes import report, run_pytest_kvprobe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a probe of a long shape runs 2-5 min here
NAME = "shadow-sglang-long-no-radix"


def test_pytest_kvprobe_long_output_without_radix_cache_runs_4(shadow_server, pytester, tmp_path, figures):
    server = shadow_server(NAME)
    result, docs = run_pytest_kvprobe(pytester, server, [NAME], tmp_path / "art")
    report(figures, "pytest --kvprobe, shared server", NAME, docs[NAME])
    print(result.stdout.str())
    result.assert_outcomes(passed=len(docs[NAME]["checks"]))
    assert docs[NAME]["verdict"]["passed"] is True
