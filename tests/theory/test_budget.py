"""Budget: seeds 000/001 numbers exactly, and the vLLM 0.33.0 fixture logs reproduced."""

import math
import re

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.model.geometry import (
    geometry_from_config,
    kv_bytes_per_token,
    load_model_config,
    weight_bytes,
)
from kvprobe.theory.sglang import budget as SB
from kvprobe.theory.vllm import budget as VB
from kvprobe.theory.vllm.batch import vllm_batch_defaults
from kvprobe.theory.vllm.releases import vllm_default_gpu_memory_utilization
from tests.engine_fixtures import FIXTURES

GIB = 2**30
NO_ESTIMATES = {"activation_bytes": 0, "cudagraph_bytes": 0, "other_bytes": 0}


@pytest.fixture(scope="module")
def llama():
    g = geometry_from_config(load_model_config("meta-llama/Llama-3.1-8B")[0])
    return g, kv_bytes_per_token(g), weight_bytes(g)


def vllm(llama, **kw):
    g, kv, w = llama
    kw.setdefault("gpu_memory_bytes", 24 * GIB)
    kw.setdefault("max_model_len", 8192)
    return VB.vllm_budget(g, kv, weights=w, **kw)


def sglang(llama, **kw):
    g, kv, w = llama
    kw.setdefault("gpu_memory_bytes", 24 * GIB)
    kw.setdefault("context_len", 131072)
    return SB.sglang_budget(g, kv, weights=w, **kw)


def test_seed001_vllm_upper_bound(llama):
    b = vllm(llama)
    assert b.requested_bytes == math.ceil(24 * GIB * 0.92)
    assert round(b.kv_pool_bytes_upper / GIB, 2) == 7.12
    assert b.kv_tokens_upper == 58_347 == (math.ceil(24 * GIB * 0.92) - 8_030_261_248 * 2) // 131072
    # estimates are subtracted from the pool, never from the upper bound
    assert b.kv_pool_bytes == b.kv_pool_bytes_upper - b.other - b.activation - b.cudagraph
    assert set(b.estimates) == {"activation_bytes", "cudagraph_bytes", "other_bytes"}


def _capacity_line(name):
    text = (FIXTURES / name).read_text()
    m = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                  r"([\d.]+)x", text)
    return int(m[1].replace(",", "")), int(m[2].replace(",", "")), m[3]


def test_fixture_startup_log_3646_blocks(llama):
    tokens, max_len, conc = _capacity_line("vllm-0.33.0-startup.log")
    b = vllm(llama, estimates=NO_ESTIMATES)  # the fixture's pool is the seed's upper bound
    assert (b.num_blocks, b.block_size, b.bytes_per_block) == (3646, 16, 2 * 2**20)
    assert (b.kv_tokens, b.max_model_len, f"{b.max_concurrency_at_max_model_len:.2f}") == (tokens, max_len, conc)
    assert (tokens, conc) == (58_336, "7.12")
    assert VB.vllm_capacity_numbers(3646, 16, 8192) == (58_336, 3646 / 512)


def test_fixture_override_log(llama):
    tokens, max_len, conc = _capacity_line("vllm-0.33.0-startup-override.log")
    b = vllm(llama, num_gpu_blocks_override=2048)
    assert (b.num_blocks, b.kv_tokens, f"{b.max_concurrency_at_max_model_len:.2f}") == (2048, tokens, conc)
    assert (tokens, conc) == (32_768, "4.00")
    assert b.source == "num_gpu_blocks_override" and b.usable_blocks == 2047


def test_fixture_autofit_log(llama):
    tokens, max_len, conc = _capacity_line("vllm-0.33.0-startup-autofit.log")
    b = vllm(llama, max_model_len=131072, auto_fit=True, estimates=NO_ESTIMATES)
    assert b.max_model_len == max_len == 58_320
    assert (b.kv_tokens, f"{b.max_concurrency_at_max_model_len:.2f}") == (tokens, conc)


def test_fixture_toosmall_refusal_text(llama):
    expected = (FIXTURES / "vllm-0.33.0-startup.md").read_text()
    quoted = re.search(r"```\n(To serve at least one request.*?)\n```", expected, re.S)[1]
    with pytest.raises(ConfigError) as err:
        vllm(llama, max_model_len=131072, estimates=NO_ESTIMATES)
    assert str(err.value) == quoted
    assert "estimated maximum model length is 58320" in str(err.value)


def test_refusal_boundary_is_usable_blocks():
    # seed 000: 256 blocks cannot hold a 4096-token request (255 usable, the null block aside:
    # kv_cache_planning.py _check_enough_kv_cache_memory), 257 can
    with pytest.raises(ConfigError, match="estimated maximum model length is 4080"):
        VB.vllm_check_fits(256, 2 * 2**20, 16, 4096, 255 * 2 * 2**20)
    VB.vllm_check_fits(257, 2 * 2**20, 16, 4096, 256 * 2 * 2**20)
    with pytest.raises(ConfigError, match="No available memory"):
        VB.vllm_check_fits(0, 2 * 2**20, 16, 4096, -5)


def test_seed000_block_examples():
    # 1000 blocks of 16: P=512 with max output 4096 -> 288 blocks per request, 8192 -> 544
    assert -(-(512 + 4096) // 16) == 288 and -(-(512 + 8192) // 16) == 544
    # 2000 blocks, max_model_len 8192 -> 512 blocks per request -> 3.9x; 4096 -> 256 -> 7.8x
    assert VB.vllm_capacity_numbers(2000, 16, 8192) == (32_000, 2000 / 512)
    assert f"{VB.vllm_capacity_numbers(2000, 16, 8192)[1]:.1f}" == "3.9"
    assert f"{VB.vllm_capacity_numbers(2000, 16, 4096)[1]:.1f}" == "7.8"


def test_kv_cache_memory_bytes_replaces_pool(llama):
    b = vllm(llama, kv_cache_memory_bytes=4 * GIB)
    assert b.kv_pool_bytes == 4 * GIB and b.num_blocks == 2048 and b.fraction is None


def test_vllm_defaults_by_version_and_tier():
    assert vllm_default_gpu_memory_utilization("0.33.0") == 0.92
    assert vllm_default_gpu_memory_utilization("0.11.0") == 0.9
    assert vllm_default_gpu_memory_utilization("0.9.2") == 0.9
    assert vllm_default_gpu_memory_utilization("0.40.1") == 0.92
    assert vllm_batch_defaults(24 * GIB, 8192) == (256, 2048)
    assert vllm_batch_defaults(80 * GIB, 8192) == (1024, 8192)
    assert vllm_batch_defaults(80 * GIB, 8192, gpu_name="NVIDIA A100-SXM4-80GB") == (256, 2048)
    assert vllm_batch_defaults(192 * GIB, 8192) == (1024, 16384)
    assert vllm_batch_defaults(80 * GIB, 4) == (1024, 4096)  # capped at seqs x max_model_len


def test_mla_block_size_and_bytes_per_block():
    g = geometry_from_config(load_model_config("zai-org/GLM-5.3")[0])
    kv = kv_bytes_per_token(g, kv_cache_dtype="fp8_ds_mla", tp=8)
    b = VB.vllm_budget(g, kv, weights=0, gpu_memory_bytes=None, max_model_len=8192,
                      num_gpu_blocks_override=1000)
    assert (b.block_size, b.bytes_per_block) == (64, 3_452_160)


def test_seed001_sglang_default_fraction(llama):
    b = sglang(llama)
    assert (b.chunked_prefill_size, b.cuda_graph_max_bs) == (4096, 48)
    assert b.reserved_mib == 512 + 4096 * 1.5 + 128 + 48 * 2 + 50 * 8 == 7280
    assert b.fraction == 0.704
    assert round(b.kv_pool_bytes / GIB, 2) == 1.94
    assert b.max_total_num_tokens == 15_879
    assert b.max_running_requests == 2048
    assert b.max_req_input_len == 15_879 - 1 - 5


def test_seed001_sglang_cps_2048(llama):
    b = sglang(llama, chunked_prefill_size=2048)
    assert b.fraction == 0.831
    assert round(b.kv_pool_bytes / GIB, 2) == 4.99


def test_prefill_capture_list_lengths():
    assert [len(SB.sglang_prefill_graph_sizes(n)) for n in (8192, 4096, 2048)] == [58, 50, 42]
    sizes = SB.sglang_prefill_graph_sizes(8192)
    assert sizes[:3] == [4, 8, 12] and sizes[-1] == 8192 and sizes == sorted(set(sizes))


def test_sglang_reference_table_fractions():
    # SGLang's default formula (arg_groups/memory_hook.py), TP1, non-MLA: H200 0.903, H100-80G 0.830,
    # A100-40G 0.823
    for mib, expected in ((143771, 0.903), (81559, 0.830), (40960, 0.823)):
        cps, bs = SB.sglang_gpu_tier(mib)
        assert SB.sglang_default_mem_fraction_static(mib, chunked_prefill_size=cps, cuda_graph_max_bs=bs) == expected
    # > 60 GiB: 10 GiB floor; MLA reserves 1.5 GiB for prefill graphs whatever the list length
    assert SB.sglang_reserved_mib(81559, chunked_prefill_size=2048, cuda_graph_max_bs=8) == 10 * 1024
    assert SB.sglang_reserved_mib(24576, chunked_prefill_size=4096, cuda_graph_max_bs=48, mla=True) == \
        512 + 6144 + 128 + 96 + 1536


def test_sglang_explicit_fraction_max_total_tokens_and_pages(llama):
    b = sglang(llama, mem_fraction_static=0.8, max_total_tokens=10_001, page_size=16)
    assert b.fraction_source == "--mem-fraction-static" and b.reserved_mib is None
    assert b.max_total_num_tokens == 10_000 and b.profiled_tokens > 10_001
    bigger = sglang(llama, mem_fraction_static=0.8, max_total_tokens=10**7)
    assert bigger.max_total_num_tokens == bigger.profiled_tokens  # min(profiled, user)


def test_sglang_max_running_requests_rules():
    assert SB.sglang_default_max_running_requests(16384, 32768) == 2048
    assert SB.sglang_default_max_running_requests(10**6, 8192) == 4096
    assert SB.sglang_default_max_running_requests(1000, 8192) == 500  # M // 2
    assert SB.sglang_default_max_running_requests(10**6, 8192, 64, dp=4) == 16
    assert SB.sglang_default_max_running_requests(100, 8192, 500) == 50
    assert SB.sglang_max_req_input_len(8192, 10**6) == 8186


def test_nothing_left_for_kv_is_a_config_error(llama):
    with pytest.raises(ConfigError, match="No available memory"):
        vllm(llama, gpu_memory_bytes=16 * GIB)
    with pytest.raises(ConfigError, match="leave no GPU memory"):
        sglang(llama, gpu_memory_bytes=16 * GIB)
    with pytest.raises(ConfigError, match="gpu_memory"):
        vllm(llama, gpu_memory_bytes=None)
    with pytest.raises(ConfigError, match="unknown estimate"):
        vllm(llama, estimates={"activations": 1})


@pytest.mark.parametrize("model", ["openai/gpt-oss-20b", "Qwen/Qwen3-Next-80B-A3B-Instruct",
                                   "mistralai/Mistral-7B-v0.1"])
def test_uniform_budgets_refuse_hybrid_models_instead_of_sizing_them_as_full(model):
    """vLLM's budget plans a hybrid model only with the plan's options, SGLang's with the config.json
    and its hybrid options (the ledger passes both)."""
    g = geometry_from_config(load_model_config(model)[0], model)
    kv = kv_bytes_per_token(g)
    with pytest.raises(ConfigError, match="hybrid plan's options") as err:
        VB.vllm_budget(g, kv, weights=0, gpu_memory_bytes=None, max_model_len=4096, num_gpu_blocks_override=100)
    assert err.value.key == g.layers.key
    with pytest.raises(ConfigError, match="needs the model's config.json and the hybrid options") as err:
        SB.sglang_budget(g, kv, weights=0, gpu_memory_bytes=None, context_len=4096, max_total_tokens=10000)
    assert err.value.key == g.layers.key


@pytest.mark.parametrize(("version", "eager", "other_mib"), [
    ("0.17.1", False, 80),  # the window holds profile_run alone (0.17.1 gpu_worker.py L386-393)
    ("0.19.1", False, 256),  # ... and profile_cudagraph_memory (0.19.1 L366-391)
    ("0.19.1", True, 80),  # skipped under --enforce-eager (0.18.1 L397-399)
    ("0.24.0", True, 80),
    ("0.27.1", False, 256),  # the free memory consumed since the snapshot (0.27.0 mem_utils.py L317-326)
])
def test_what_the_profiling_window_holds_sets_the_non_torch_term(llama, version, eager, other_mib):
    b = vllm(llama, version=version, enforce_eager=eager)
    assert b.other == other_mib * 2**20
    assert ("--enforce-eager" in b.rules) == eager
    if eager:  # no graph profiled, none captured: the graph estimate (where subtracted) and 176 MiB back
        graphs = vllm(llama, version=version)
        back = (graphs.cudagraph if graphs.cudagraph_subtracted else 0) + (256 - 80) * 2**20
        assert b.cudagraph == 0 and b.kv_pool_bytes == graphs.kv_pool_bytes + back
