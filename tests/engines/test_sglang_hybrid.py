"""The SGLang dialect's hybrid-pool facts against what a real SGLang 0.5.23 said (recorded from the
shadow: tests/engines/published/README.md): the startup lines of a window pool and of a state pool,
and the per-pool gauges of /metrics parsed with prometheus_client."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvprobe.engines import sglang as dialect

PUBLISHED = Path(__file__).resolve().parent / "published"


def _text(name: str) -> str:
    return (PUBLISHED / f"sglang-0.5.23-{name}").read_text()


def _families(name: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(_text(name))}


def test_window_pool_startup_lines():
    text = _text("gpt-oss-20b-startup.log")
    # the first "Use sliding window memory pool" line is the unbounded budget before --max-total-tokens
    assert dialect.parse_hybrid_startup(text) == {"full_tokens": 4096, "swa_tokens": 3276, "kv_dtype": "torch.float16"}
    rep = dialect.parse_startup_log(text)
    assert (rep.kv_tokens, rep.max_running, rep.max_model_len) == (4096, 2048, 2048)


def test_state_pool_startup_lines():
    text = _text("qwen3-next-startup.log")
    assert dialect.parse_hybrid_startup(text) == {
        "full_tokens": 4096, "kv_dtype": "torch.bfloat16", "mamba_slots": 24, "mamba_capped_running": 8,
        "mamba_slots_per_request": 3}
    assert dialect.parse_startup_log(text).max_running == 8


def test_a_full_attention_log_says_nothing_of_hybrid_pools():
    text = "[2026-12-01 10:00:00] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 16384, K size: 1.00 GB"
    assert dialect.parse_hybrid_startup(text) == {"full_tokens": 16384, "kv_dtype": "torch.bfloat16"}


@pytest.mark.parametrize("name", ["gpt-oss-20b-metrics.txt", "qwen3-next-metrics.txt"])
def test_every_hybrid_gauge_name_is_one_sglang_serves(name):
    families = _families(name)
    missing = [m for role, m in dialect.HYBRID_METRICS.items() if m not in families and role != "swa_pool_tokens"]
    assert missing == []
    for m in dialect.HYBRID_METRICS.values():
        if m in families:
            assert families[m].type == "gauge", m


def test_window_pool_gauges_are_sglangs_own_ratios():
    """pool_stats_observer.py `_get_swa_token_info`: used / capacity per pool, the window pool smaller
    and less used once tokens fell out of the window."""
    g = dialect.hybrid_gauges(_families("gpt-oss-20b-metrics.txt"))
    assert g["swa_pool_tokens"] == 3276
    assert g["swa_usage"] == pytest.approx(g["swa_used_tokens"] / 3276)
    assert g["swa_used_tokens"] + g["swa_available_tokens"] + g["swa_evictable_tokens"] == 3276
    assert g["swa_used_tokens"] < g["full_usage"] * 4096
    assert g["mamba_usage"] == 0.0


def test_state_pool_gauges_count_slots():
    g = dialect.hybrid_gauges(_families("qwen3-next-metrics.txt"))
    assert "swa_pool_tokens" not in g  # emitted only for a window pool (emit_constants)
    assert g["mamba_used_slots"] + g["mamba_available_slots"] + g["mamba_evictable_slots"] == 24
    assert g["mamba_usage"] == pytest.approx(g["mamba_used_slots"] / 24)
