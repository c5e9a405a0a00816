"""A declared GPU sizes the pool: the plugin hands SGLang the KV budget that GPU would leave
(kvprobe's ledger: its memory and the model's weights) and SGLang's own configurator turns it into
tokens with the --mem-fraction-static it resolved — so the flag has its effect, as on the GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvprobe.spec_schema import Hardware
from kvprobe.theory.ledger import LedgerInputs, build_ledger

from .conftest import shipped, start_server, stop_server

pytestmark = pytest.mark.slow
GIB = 2**30


def test_declared_gpu_and_mem_fraction_static_size_the_pool_as_the_ledger_does(sglang_env, tmp_path, figures):
    base = shipped("shadow-sglang-kv")
    flags = {"context-length": 2048, "mem-fraction-static": 0.75, "enable-metrics": True}
    exp = replace(base, flags=flags, hardware=Hardware(gpu_memory_bytes=24 * GIB))
    led = build_ledger(LedgerInputs(engine="sglang", model=exp.model, gpu_memory_bytes=24 * GIB,
                                    context_length=2048, mem_fraction_static=0.75))
    default = build_ledger(LedgerInputs(engine="sglang", model=exp.model, gpu_memory_bytes=24 * GIB,
                                        context_length=2048)).budget
    server = start_server(exp, tmp_path / "engine.log")
    try:
        info = server.server_info()
        reported = info["max_total_num_tokens"]
        sizing = server.target.facts().shadow.get("pool_sizing", "")
        figures(f"declared GPU 24 GiB, --mem-fraction-static 0.75: SGLang's pool {reported} tokens, "
                f"ledger {led.budget.max_total_num_tokens} (SGLang's default fraction {default.fraction} would "
                f"give {default.max_total_num_tokens}); plugin: {sizing}")
        assert info["mem_fraction_static"] == 0.75
        assert sizing.startswith("declared GPU free 24.00 GiB") and "mem_fraction_static 0.75" in sizing
        assert reported == led.budget.max_total_num_tokens
        assert server.gauge("pool_tokens") == reported
    finally:
        stop_server(server)
