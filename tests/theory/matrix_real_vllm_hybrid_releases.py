"""The hybrid simulation against every installed vLLM release's own scheduler, step by step (opt-in: `make matrix`).

tests/theory/test_real_vllm_hybrid.py checks 0.33.0 and test_real_vllm_hybrid_first_chunk.py 0.18.1; this
module drives every release this machine has an environment of (kvprobe.targets.shadow.recipes.installed)
through the same closed loops with the same driver (tests/theory/real/vllm_driver.py), each against the
simulation configured as the ledger configures that release (build_ledger: `policy(version)` and
`window_rules(version)` of kvprobe/theory/vllm/releases.py). gpt-oss-20b's groups (window 128 and full,
blocks of 16) in one pool, max_model_len 4096, a 512-token budget, max_num_seqs 16, the ledger's ramp (width
8), async and sync:
- "P=1000 O=200": expectations/diff/vllm-hybrid-window-shadow.yaml's shape, 400 blocks, 7 and 9 users
  (requests wait; first-chunk releases preempt too);
- "long outputs": 400 blocks, P=1000, O=1500, 3 and 4 users: outputs grow past the pool, so whole-prompt
  releases preempt as well, and a preempted request comes back to what the pool kept of it (the pool rules);
- "P=1500 window cap": expectations/diff/vllm-window-cap-shadow.yaml's shape, 700 blocks, P=1500, O=200, 9
  and 12 users (the full-sequence check's charge of the window group).
The running and waiting counts, the pool's free blocks after every step and the preemptions must equal the
release's, on every release (0.23.0's free order was found here, below); each rule the simulation switches per
release must be seen by these shapes (the other way, it departs).

Not collected by `make test` (its name is not test_*.py): run it by path,
`pytest tests/theory/matrix_real_vllm_hybrid_releases.py` (the Makefile's `matrix`).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from kvprobe.targets.shadow.recipes import installed
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.schedsim import VllmConfig, arrival_steps, request_lifetime
from kvprobe.theory.vllm.hybrid.block_pool import SPLIT, TAIL, WINDOW_SPLIT
from kvprobe.theory.vllm.hybrid.kv_cache_manager import KVGroup
from kvprobe.theory.vllm.releases import policy, window_rules
from tests.engine_envs import engine_env
from tests.theory.test_real_vllm import _run_driver, model_dir  # noqa: F401  (the fixture)
from tests.theory.test_real_vllm_hybrid import driver_spec, simulated

pytestmark = pytest.mark.slow

RELEASES = installed("vllm")
WIDTH = 8  # the ledger's ramp
SHAPES = {  # name: (blocks, P, O, users, steps)
    "P=1000 O=200": (400, 1000, 200, (7, 9), 1500),
    "long outputs": (400, 1000, 1500, (3, 4), 4000),
    "P=1500 window cap": (700, 1500, 200, (9, 12), 1500),
}
CASES = [(s, a, n) for s, (*_, users, _) in SHAPES.items() for a in (True, False) for n in users]

# 0.23.x splits freed blocks (no hash: head of the free queue) only in a group's skipped blocks and a window
# group's freed request, a full group's request to the tail (releases.py UNHASHED_FIRST_WINDOW_FROM): found
# here, on "long outputs" (sync, 3 users: step 2001 simulated (3, 0, 100) against vLLM's (2, 1, 202) while
# kvprobe took 0.23.x at 0.24.0's every-group split).


def case_id(version: str, shape: str, a: bool, n: int) -> str:
    return f"{version}-{shape}-{'async' if a else 'sync'}-{n}"


@functools.cache
def ledger_config(version: str, shape: str, async_scheduling: bool) -> VllmConfig:
    blocks, P, O, _, _ = SHAPES[shape]  # noqa: E741
    return build_ledger(LedgerInputs(
        engine="vllm", model="openai/gpt-oss-20b", engine_version=version, max_model_len=4096, max_num_seqs=16,
        max_num_batched_tokens=512, num_gpu_blocks_override=blocks, block_size=16, async_scheduling=async_scheduling,
        prompt_tokens=P, output_tokens=O)).scheduler_config


def loop(cfg: VllmConfig, shape: str, users: int) -> tuple:
    _, P, O, _, steps = SHAPES[shape]  # noqa: E741
    return P, O, users, arrival_steps(request_lifetime(cfg, P, O), users, "ramp", WIDTH), steps


@pytest.fixture(scope="module")
def release_runs(request, model_dir):  # noqa: F811
    """vLLM `version`'s trace and preemptions of every case, one driver run per release (kept for the module)."""
    runs: dict[str, dict] = {}

    def get(version: str) -> dict:
        if version not in runs:
            env = engine_env("vllm", version, request.config)
            specs = [driver_spec(model_dir, ledger_config(version, s, a), *loop(ledger_config(version, s, a), s, n))
                     for s, a, n in CASES]
            runs[version] = dict(zip(CASES, _run_driver(env, specs), strict=True))
        return runs[version]
    return get


def first_difference(sim: list, engine: list) -> int | None:
    return next((t for t, (a, b) in enumerate(zip(sim, engine, strict=True)) if a != b), None)


@pytest.mark.parametrize(
    "version, shape, async_scheduling, users",
    [(v, s, a, n) for v in RELEASES for s, a, n in CASES],
    ids=[case_id(v, *c) for v in RELEASES for c in CASES])
def test_simulation_equals_the_releases_scheduler_step_by_step(release_runs, version, shape, async_scheduling,
                                                               users):
    cfg = ledger_config(version, shape, async_scheduling)
    rules = window_rules(version)
    assert cfg.groups == (KVGroup("sliding", window=128), KVGroup("full"))
    assert (cfg.policy, cfg.window_admission_cap, cfg.window_in_flight, cfg.free_order,
            cfg.sparse_retention) == (policy(version), rules.admission_cap, rules.in_flight, rules.free_order,
                                      rules.sparse_retention)
    real = release_runs(version)[(shape, async_scheduling, users)]
    sim, preemptions = simulated(cfg, *loop(cfg, shape, users))
    engine = [tuple(x) for x in real["trace"]]
    first = first_difference(sim, engine)
    assert first is None, f"vLLM {version}: step {first}: simulated {sim[first]}, vLLM {engine[first]}"
    assert preemptions == real["preemptions"]
    assert max(w for _, w, _ in sim) > 0  # the pool binds: requests wait
    if shape == "long outputs":
        assert preemptions > 0  # and decode outgrows it


RULES = ("window_admission_cap", "window_in_flight", "free_order", "sparse_retention")
# the other way for each rule: a switch, or the free order a release would have on the other side of its boundary
OTHER_ORDER = {TAIL: SPLIT, WINDOW_SPLIT: SPLIT, SPLIT: TAIL}


def flip(cfg: VllmConfig, rule: str) -> VllmConfig:
    value = getattr(cfg, rule)
    return dataclasses.replace(cfg, **{rule: OTHER_ORDER[value] if rule == "free_order" else not value})


def blind(version: str, rule: str) -> bool:
    """Rules these shapes cannot see on `version`: no full-sequence check to cap before 0.19.0 (first-chunk
    admission), and with sparse retention no freed block the free queue's order would keep for a hit."""
    cfg = ledger_config(version, "P=1000 O=200", True)
    return (rule == "window_admission_cap" and cfg.policy == "vllm-0.11") or \
        (rule == "free_order" and cfg.sparse_retention)


@pytest.mark.parametrize(
    "version, rule",
    [(v, r) for v in RELEASES for r in RULES if not blind(v, r)],
    ids=[f"{v}-{r}" for v in RELEASES for r in RULES if not blind(v, r)])
def test_each_rule_is_seen(release_runs, version, rule):
    """With one window rule the other way, the simulation departs from the release in at least one case:
    the shapes tell each rule kvprobe switches per release."""
    departs = []
    for shape, a, n in CASES:
        cfg = ledger_config(version, shape, a)
        sim, _ = simulated(flip(cfg, rule), *loop(cfg, shape, n))
        if sim != [tuple(x) for x in release_runs(version)[(shape, a, n)]["trace"]]:
            departs.append((shape, a, n))
    assert departs, f"no case tells vLLM {version}'s {rule}={getattr(ledger_config(version, CASES[0][0], True), rule)}"
