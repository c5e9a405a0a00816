"""The Gated DeltaNet checkpoint rule (kvprobe/theory/vllm/releases.py MAMBA_CHECKPOINTS_FROM) and the step a
hybrid block is raised in (ALIGN_ON_GIVEN_BLOCK_FROM) read in each installed vLLM's own source.

The shadow worker writes a GDN layer's KV spec itself (the real layer needs a model built on a GPU), so a
shadow's capacity line follows kvprobe's rule whichever release it names: running the releases either side
shows that vLLM's planner and scheduler agree with the ledger on those specs, not where the rule changed. This
reads it where it lives: whether Qwen3-Next's GDN layer class defines its own `get_kv_cache_spec` that sets
`num_prefill_checkpoint_blocks` (qwen_gdn_linear_attn.py L739-750 in 0.33.0; the base Mamba layer's spec, with
the default 0, through 0.32.0), and whether `Platform._align_hybrid_block_size` puts the block on the
checkpoint grid (platforms/interface.py L1089-1094 in 0.33.0). Both must say what the rule says.

0.18.1 and 0.33.0 (the environments `make test` holds) always; every other installed vLLM environment too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvprobe.releases import version_tuple
from kvprobe.targets.shadow import recipes
from kvprobe.theory.vllm.releases import window_rules
from tests.engine_envs import engine_env

pytestmark = pytest.mark.slow
# Qwen3-Next's GDN layer, first found first: layers/mamba/gdn/qwen_gdn_linear_attn.py from 0.22.1, whose base
# GatedDeltaNetAttention (gdn/base.py) is the layer itself in 0.19.1-0.21.0 (layers/mamba/gdn_linear_attn.py);
# models/qwen3_next.py's own class in 0.18.1
GDN_CLASSES = ("QwenGatedDeltaNetAttention", "GatedDeltaNetAttention", "Qwen3NextGatedDeltaNet")
RELEASES = sorted({"0.18.1", "0.33.0", *recipes.installed("vllm")}, key=version_tuple)


def _class(root: Path, names: tuple[str, ...]) -> tuple[Path, ast.ClassDef, str]:
    """The class named the first of `names` that `root` defines: its file, node and source."""
    sources = [(path, path.read_text(encoding="utf-8", errors="replace")) for path in sorted(root.rglob("*.py"))]
    for name in names:
        for path, text in sources:
            if not re.search(rf"^class {name}\b", text, re.M):
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return path, node, text
    raise AssertionError(f"no class {' or '.join(names)} under {root}")


def _method(cls: ast.ClassDef, text: str, name: str) -> str | None:
    """The source of `name` where `cls` defines it itself (not inherited), else None."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node)
    return None


ALIGNED = "to ensure that attention page size is >= mamba page size"  # what the function that raises the block logs


def _aligner(vllm: Path) -> tuple[str, str]:
    """Where the release raises a hybrid model's attention block to hold a Mamba state, and that function's
    source (`Platform._align_hybrid_block_size`, platforms/interface.py; models/config.py in 0.18.1)."""
    for path in sorted(vllm.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if ALIGNED not in text:
            continue
        funcs = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)
                 and ALIGNED in (ast.get_source_segment(text, n) or "")]
        inner = min(funcs, key=lambda n: n.end_lineno - n.lineno)
        return f"{path.relative_to(vllm)}::{inner.name}", ast.get_source_segment(text, inner)
    raise AssertionError(f"nothing under {vllm} logs {ALIGNED!r}")


def read_rule(vllm: Path) -> dict:
    """What this release's own source says: does the GDN layer set a checkpoint block, and does the block
    alignment put the hybrid block on the checkpoint grid?"""
    path, gdn, text = _class(vllm / "model_executor", GDN_CLASSES)
    spec = _method(gdn, text, "get_kv_cache_spec")
    where, align = _aligner(vllm)
    return {"layer": f"{path.relative_to(vllm)}::{gdn.name}", "aligner": where,
            "layer_checkpoint": spec is not None and "num_prefill_checkpoint_blocks" in spec,
            "grid": "checkpoint_alignment" in align,
            # max(the backend's smallest kernel block, cache_config.block_size) / a fixed 16 (0.18.1 L149)
            "align_on_given": re.search(r"kernel_block_alignment_size = max\(", align) is not None}


@pytest.mark.parametrize("version", RELEASES)
def test_the_gdn_checkpoint_rule_is_the_one_in_the_releases_source(pytestconfig, version):
    env = engine_env("vllm", version, pytestconfig)
    got = read_rule(env.site_packages / "vllm")
    expected = window_rules(version).mamba_checkpoints
    assert got["layer_checkpoint"] is expected and got["grid"] is expected, (version, expected, got)
    # the step a hybrid block is raised in (releases.py ALIGN_ON_GIVEN_BLOCK_FROM)
    assert got["align_on_given"] is window_rules(version).align_on_given_block, (version, got)


def test_the_reader_sees_a_layer_that_sets_checkpoints(tmp_path):
    """The reader on a stand-in package: a layer defining its own spec with a checkpoint block, and one that
    inherits its spec (so a release whose layer changed would fail the test above)."""
    (tmp_path / "model_executor").mkdir()
    (tmp_path / "platforms").mkdir()
    (tmp_path / "platforms" / "interface.py").write_text(
        f"class Platform:\n    def _align_hybrid_block_size(cls):\n        get_mamba_prefill_checkpoint_alignment()\n"
        f"        logger.info('Setting attention block size {ALIGNED}.')\n")
    layer = tmp_path / "model_executor" / "gdn.py"
    layer.write_text("class QwenGatedDeltaNetAttention(Base):\n    def get_kv_cache_spec(self, c):\n"
                     "        return replace(spec, num_prefill_checkpoint_blocks=1)\n")
    assert read_rule(tmp_path) == {"layer": "model_executor/gdn.py::QwenGatedDeltaNetAttention",
                                   "aligner": "platforms/interface.py::_align_hybrid_block_size",
                                   "layer_checkpoint": True, "grid": True, "align_on_given": False}
    layer.write_text("class QwenGatedDeltaNetAttention(Base):\n    pass\n")
    assert read_rule(tmp_path)["layer_checkpoint"] is False
