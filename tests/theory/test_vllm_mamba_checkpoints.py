"""A Gated DeltaNet layer's spec with and without the release's prefill checkpoints
(kvprobe/theory/vllm/hybrid/kv_cache_spec.py `VllmOptions.prefill_checkpoints`): 0.33.0's "align" mode takes
FlashInfer's 64-token grid and one checkpoint block a request (Qwen3-Next: 576-token blocks, 3 state blocks);
through 0.32.0 the GDN layer sets no checkpoint (0.25.1-0.28.0's MambaSpec has no such field, 0.29.0-0.32.0's
leaves it 0), so "align" there is the kernel alignment alone and two state blocks (544-token blocks), as the
shadow worker writes them on those releases (compat.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.model.geometry import geometry_from_config, load_model_config
from kvprobe.theory.vllm.hybrid.kv_cache_spec import MAMBA_SPEC, VllmOptions, hybrid_block_size, vllm_layer_specs

QWEN3_NEXT = "Qwen/Qwen3-Next-80B-A3B-Instruct"


@pytest.fixture(scope="module")
def geom():
    cfg, _ = load_model_config(QWEN3_NEXT)
    return geometry_from_config(cfg, QWEN3_NEXT)


@pytest.mark.parametrize(("checkpoints", "caching", "block", "ckpt", "state_blocks"), [
    (True, True, 576, 1, 3),  # 0.33.0 "align": lcm(16, 64) grid, + the checkpoint block
    (False, True, 544, 0, 2),  # 0.27.1-0.32.0 "align": 16 raised until a page holds a state
    (True, False, 544, 0, 1),  # "none": no grid, no checkpoint, on any release
    (False, False, 544, 0, 1),
])
def test_align_takes_the_checkpoint_grid_only_where_the_release_has_checkpoints(geom, checkpoints, caching, block,
                                                                                ckpt, state_blocks):
    opts = VllmOptions(max_num_batched_tokens=512, enable_prefix_caching=caching, prefill_checkpoints=checkpoints)
    assert hybrid_block_size(geom, opts)[0] == block
    specs = vllm_layer_specs(geom, opts, max_model_len=4096)
    mamba = [s for s in specs if s.spec == MAMBA_SPEC]
    assert len(mamba) == 36 and all(s.num_prefill_checkpoint_blocks == ckpt for s in mamba)
    assert all(s.blocks_per_request(4096, 1024) == state_blocks for s in mamba)
    assert all(s.prefill_checkpoint_alignment == (block if ckpt else None) for s in mamba)
    assert {s.block_size for s in specs if s.spec != MAMBA_SPEC} == {block}


def test_a_given_block_on_the_grid_is_the_same_block_either_way(geom):
    """--block-size 576 given (the first run of expectations/diff/vllm-mamba-cache-mode-shadow.yaml, docs/diff.md):
    both forms plan 576-token blocks."""
    for checkpoints in (True, False):
        opts = VllmOptions(block_size=576, max_num_batched_tokens=512, prefill_checkpoints=checkpoints)
        assert hybrid_block_size(geom, opts)[0] == 576


LOGGED = Path(__file__).resolve().parents[1] / "engines" / "published" / "vllm-qwen3-next-capacity-lines.log"


def _logged_tokens() -> dict[str, int]:
    """Each release's "KV cache size: N tokens", as its own engine logged it."""
    out, version = {}, None
    for line in LOGGED.read_text().splitlines():
        if line.startswith("# vLLM "):
            version = line.removeprefix("# vLLM ")
        elif found := re.search(r"KV cache size: ([\d,]+) tokens", line):
            out[version] = int(found.group(1).replace(",", ""))
    return out


def test_every_release_the_log_holds_is_tested():
    assert sorted(_logged_tokens()) == ["0.27.1", "0.28.0", "0.29.0", "0.32.0", "0.33.0"]


@pytest.mark.parametrize("version", ["0.27.1", "0.28.0", "0.29.0", "0.32.0", "0.33.0"])
def test_the_ledgers_capacity_line_is_the_one_each_release_logged(version):
    """The shape of expectations/diff/vllm-mamba-cache-mode-shadow.yaml, no --block-size: the release rule
    (theory/vllm/releases.py MAMBA_CHECKPOINTS_FROM) gives each release's line, 11,702 tokens before 0.33.0 and
    9,637 from it (a checkpoint block a request in each of the 3 Mamba groups)."""
    inputs = LedgerInputs(engine="vllm", model=QWEN3_NEXT, engine_version=version, num_gpu_blocks_override=40,
                          max_model_len=4096, max_num_seqs=16, max_num_batched_tokens=512, enable_prefix_caching=True,
                          prompt_tokens=1000, output_tokens=200)
    led = build_ledger(inputs)
    assert led.capacity.kv_tokens == _logged_tokens()[version]


# What vLLM 0.25.1's and 0.26.0's own start-up said of this shape (the EngineCore's last line, 2026-12-07:
# `kvprobe diff expectations/diff/vllm-mamba-cache-mode-shadow.yaml --versions 0.25.1,0.26.0`), verbatim.
REFUSED_AS = "AssertionError: In Mamba cache align mode, block_size (544) must be <= max_num_batched_tokens (512)."


@pytest.mark.parametrize(("version", "tokens", "caching", "refused"), [
    ("0.25.1", 512, True, True), ("0.26.0", 512, True, True),
    ("0.26.0", 1024, True, False),  # the block fits a step
    ("0.26.0", 512, False, False),  # "none" mode: no such check
    ("0.27.1", 512, True, False), ("0.33.0", 512, True, False),  # the check is gone (0.27.1 config/vllm.py)
])
def test_an_align_block_beyond_the_token_budget_is_refused_before_0_27(version, tokens, caching, refused):
    inputs = LedgerInputs(engine="vllm", model=QWEN3_NEXT, engine_version=version, num_gpu_blocks_override=40,
                          max_model_len=4096, max_num_seqs=16, max_num_batched_tokens=tokens,
                          enable_prefix_caching=caching, prompt_tokens=1000, output_tokens=200)
    led = build_ledger(inputs, explain_refusal=True)
    if refused:
        assert led.refusal.startswith(REFUSED_AS.removeprefix("AssertionError: ")), led.refusal
        with pytest.raises(ConfigError, match="max_num_batched_tokens"):
            build_ledger(inputs)
    else:
        assert led.refusal is None


ALIGNMENT_LOG = LOGGED.parent / "vllm-0.18.1-qwen3-next-block-alignment.log"


@pytest.mark.parametrize(("align_on_given", "given", "block"), [
    (False, 128, 544), (True, 128, 640),  # through 0.19.1 a fixed 16 / from 0.20.2 max(16, 128)
    (False, 16, 544), (True, 16, 544),  # from the default both agree
    (False, 1024, 1024), (True, 1024, 1024),  # a block that holds a state already is kept
])
def test_a_hybrid_block_is_raised_in_steps_of_16_through_0_19_and_of_the_given_block_after(geom, align_on_given, given,
                                                                                          block):
    opts = VllmOptions(block_size=given, enable_prefix_caching=False, align_on_given_block=align_on_given)
    assert hybrid_block_size(geom, opts)[0] == block


def test_the_0_18_1_ledger_is_the_engines_own_alignment_of_a_given_128():
    """vLLM 0.18.1's own config resolution (HybridAttentionMambaModelConfig, models/config.py) logged 544-token
    blocks and 3,808 tokens for Qwen3-Next with the 128-token block its CPU platform gave it (published so in
    its config); the ledger, told 128 as the probe was, says the same (640 and 4,480 with 0.20.2's step)."""
    text = ALIGNMENT_LOG.read_text()
    logged_block = int(re.search(r"Setting attention block size to (\d+) tokens", text).group(1))
    logged_tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))
    inputs = LedgerInputs(engine="vllm", model=QWEN3_NEXT, engine_version="0.18.1", num_gpu_blocks_override=30,
                          max_model_len=4096, max_num_seqs=16, max_num_batched_tokens=512, enable_prefix_caching=False,
                          block_size=128, prompt_tokens=1000, output_tokens=200)
    led = build_ledger(inputs)
    assert (led.capacity.block_size, led.capacity.kv_tokens) == (logged_block, logged_tokens) == (544, 3808)
    later = build_ledger(dataclasses.replace(inputs, engine_version="0.20.2"))
    assert (later.capacity.block_size, later.capacity.kv_tokens) == (640, 12288)
