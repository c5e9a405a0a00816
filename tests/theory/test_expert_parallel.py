"""vLLM's `--enable-expert-parallel` in the ledger: the routed experts placed whole over the TP x DP ranks
(0.29.0 `fused_moe/config.py` FusedMoEParallelConfig.make L1212-1256: ep_size = tp x dp, the MoE layer's
own tp_size 1; `fused_moe/expert_map_manager.py` determine_expert_map L67-69: the first experts % ep ranks
hold one more), everything else split by TP as before."""

from __future__ import annotations

from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.ledger.text import render_ledger
from kvprobe.theory.model.geometry import experts_on_rank, geometry_from_config, load_model_config, weight_bytes

GIB = 2**30


def _geom(name: str):
    cfg, source = load_model_config(name)
    return geometry_from_config(cfg, name, source=source)


def test_whole_experts_per_rank():
    assert experts_on_rank(32, 2) == 16  # the 0.29.0 L4 log: `Local/global number of experts: 16/32`
    assert experts_on_rank(8, 3) == 3  # 3 / 3 / 2: the most loaded rank binds
    assert experts_on_rank(128, 1) == 128


def test_bf16_experts_weigh_the_same_split_either_way():
    """128 experts of Qwen3-30B-A3B over 2 ranks: 64 whole experts or half of each, the same bytes."""
    geom = _geom("kvprobe/theory/model/configs/qwen3-30b-a3b.json")
    assert weight_bytes(geom, tp=2, engine="vllm", ep=2) == weight_bytes(geom, tp=2, engine="vllm")


def test_mxfp4_experts_under_ep_pad_the_whole_intermediate():
    """gpt-oss-20b on two Ada cards (MARLIN: H 2880 -> 3072, I per rank -> a multiple of 128, mxfp4.py).
    TP 2: 32 experts of I 1440 -> 1536, w13 32 x 3072 x (1536 + 96 + 2) + w2 32 x 3072 x (768 + 48 + 2)
    = 241,041,408 B a layer. EP 2: 16 experts of I 2880 -> 2944, w13 16 x 5888 x 1634 + w2 16 x 3072 x
    (1472 + 92 + 2) = 230,907,904 B. 24 layers: 243,204,096 B less per rank with EP."""
    geom = _geom("kvprobe/theory/model/configs/gpt-oss-20b.json")
    tp = weight_bytes(geom, tp=2, engine="vllm", gpu_arch="sm89")
    ep = weight_bytes(geom, tp=2, engine="vllm", gpu_arch="sm89", ep=2)
    assert 32 * 3072 * 1634 + 32 * 3072 * 818 == 241_041_408
    assert 16 * 5888 * 1634 + 16 * 3072 * 1566 == 230_907_904
    assert tp - ep == 24 * (241_041_408 - 230_907_904) == 243_204_096


def test_the_ledger_takes_the_flag_over_tp_and_dp():
    base = dict(engine="vllm", model="kvprobe/theory/model/configs/gpt-oss-20b.json", engine_version="0.29.0",
                gpu_memory_bytes=22 * GIB, gpu_arch="sm89", tp=2, max_model_len=8192)
    plain = build_ledger(LedgerInputs(**base))
    ep = build_ledger(LedgerInputs(**base, enable_expert_parallel=True))
    assert plain.model.weight_bytes - ep.model.weight_bytes == 243_204_096
    assert "TP2 PP1 DP1 EP2" in render_ledger(ep)
    one_rank = dict(base, tp=1)  # one rank: vLLM's use_ep needs tp x dp > 1
    assert (build_ledger(LedgerInputs(**one_rank, enable_expert_parallel=True)).model.weight_bytes
            == build_ledger(LedgerInputs(**one_rank)).model.weight_bytes)



def test_one_rank_prints_no_ep():
    """TP x DP of 1: no expert parallelism (vLLM's use_ep needs more than one rank), so the row says none."""
    led = build_ledger(LedgerInputs(engine="vllm", model="kvprobe/theory/model/configs/gpt-oss-20b.json",
                                    engine_version="0.29.0", gpu_memory_bytes=22 * GIB, gpu_arch="sm89",
                                    max_model_len=8192, enable_expert_parallel=True))
    row = next(line for line in render_ledger(led).splitlines() if line.startswith("weights per rank"))
    assert "TP1 PP1 DP1," in row and "EP" not in row
