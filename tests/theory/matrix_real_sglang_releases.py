"""The simulation against older SGLang releases' own Scheduler, step by step (opt-in: `make matrix`).

tests/theory/test_real_sglang.py drives SGLang 0.5.23's Scheduler (the suite's environment) through
kvprobe's closed loop; this module drives 0.5.19, 0.5.21 and 0.5.22 with the same driver
(tests/theory/real/sglang_driver.py) against the simulation configured as each release
(kvprobe/theory/sglang/releases.py: its admission `policy` and its `scheduler_rules`). The three
bracket the two older scheduler-loop rules: 0.5.22 still keeps a finished request in the running
batch until the next decode step (0.5.23 filters every step, scheduler.py L3963-3968), and 0.5.21
still decodes a request whose in-flight token is its last (0.5.22 added `_reqs_finishing_inflight`).

Not collected by `make test` (its name is not test_*.py, and the suite has no environment of these
releases): run it by path, `pytest tests/theory/matrix_real_sglang_releases.py` (the Makefile's
`matrix`); a missing environment is installed (tests/engine_envs.py), ~2.4 GB each.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvprobe.theory.schedsim import SglangConfig, arrival_steps, request_lifetime
from kvprobe.theory.sglang.admission import spread_ramp_width
from kvprobe.theory.sglang.releases import policy, scheduler_rules
from tests.engine_envs import engine_env
from tests.theory.test_real_sglang import MODEL, SHAPES, _case, _first_difference, model_trace, real_spec, real_traces

pytestmark = pytest.mark.slow

RELEASES = ("0.5.19", "0.5.21", "0.5.22")
# The release whose rules come next after each (what the simulation would run with one rule less)
NEXT = {"0.5.19": "0.5.23", "0.5.21": "0.5.22", "0.5.22": "0.5.23"}

# The shapes of test_real_sglang that exercise admission after finishes, with retraction and EOS; pages
# of 1 only: 0.5.19's paged allocator runs a Triton kernel (mem_cache/allocator/paged.py L197), which
# has no CPU driver
PLAIN = ["exact fit, ramp", "exact fit, burst", "retraction", "max_running_requests 12", "EOS at 100 of 400",
         "overlap off, retraction", "shared prefix 256", "radix off, retraction, chunks"]

# The mid-tier pair's 0.5.19 side (expectations/diff/sglang-mid-tier-shadow.yaml, tests/theory/
# test_sglang_cohorts.py): P=1760 O=32 on 41,242 tokens, 2,048-token chunks, 34 users
MID_P, MID_O, MID_USERS = 1760, 32, 34
MID_TIER = SglangConfig(max_total_num_tokens=41242, page_size=1, max_running_requests=4096,
                        chunked_prefill_size=2048, context_len=2048)
# its 0.5.20 side: 15,879 tokens, 4,096-token chunks (7.56 running in the spread loop on 0.5.20's own
# Scheduler, as the ledger now says; 7.79 with 0.5.23's scheduler loop)
MID_TIER_0520 = dataclasses.replace(MID_TIER, max_total_num_tokens=15879, max_running_requests=3969,
                                    chunked_prefill_size=4096)


def mid_tier_arrivals(cfg: SglangConfig, start: str, estimate: float) -> list[int]:
    life = request_lifetime(cfg, MID_P, MID_O)
    width = spread_ramp_width(cfg, MID_P, MID_O, estimate) if start == "spread" else None
    return arrival_steps(life, MID_USERS, "burst" if start == "burst" else "ramp", width)


MID = {"mid-tier, spread": (MID_TIER, "spread", 23), "mid-tier, burst": (MID_TIER, "burst", 23),
       "mid-tier 0.5.20 pool, spread": (MID_TIER_0520, "spread", 8)}
STEPS = 1500


def as_release(cfg: SglangConfig, version: str) -> SglangConfig:
    """The simulation's config of `version`: its admission policy and scheduler-loop rules."""
    return dataclasses.replace(cfg, policy=policy(version), **scheduler_rules(version))


def case(name: str, version: str) -> tuple:
    if name in MID:
        cfg, start, estimate = MID[name]
        return (as_release(cfg, version), MID_P, MID_O, 0, MID_USERS, mid_tier_arrivals(cfg, start, estimate),
                STEPS, True)
    cfg, *rest = _case(name)
    return (as_release(cfg, version), *rest)


NAMES = [*PLAIN, *MID]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("sglang-model")
    (d / "config.json").write_text(json.dumps(MODEL))
    return str(d)


@pytest.fixture(scope="module", params=RELEASES)
def release_traces(request, model_folder) -> tuple[str, dict]:
    """One release's SGLang traces of every shape (one driver run in that release's environment)."""
    version = request.param
    env = engine_env("sglang", version, request.config)
    specs = [real_spec(model_folder, *case(n, version)) for n in NAMES]
    return version, dict(zip(NAMES, real_traces(env, specs), strict=True))


def test_the_shapes_are_test_real_sglangs():
    assert set(PLAIN) <= set(SHAPES)


@pytest.mark.parametrize("name", NAMES)
def test_simulation_equals_the_releases_scheduler_step_by_step(release_traces, name):
    version, traces = release_traces
    real = traces[name]
    assert "error" not in real, real.get("error")
    sim = model_trace(*case(name, version))
    diff = _first_difference(sim, real["trace"])
    assert diff is None, f"SGLang {version}: {diff}"
    assert max(row[0] for row in sim) > 1


def test_each_rule_is_needed(release_traces):
    """With the next release's scheduler-loop rules (one rule less) the simulation departs from
    this release's scheduler in at least one shape."""
    version, traces = release_traces
    departs = []
    for name in NAMES:
        cfg, *rest = case(name, version)
        wrong = dataclasses.replace(cfg, **scheduler_rules(NEXT[version]))
        if _first_difference(model_trace(wrong, *rest), traces[name]["trace"]) is not None:
            departs.append(name)
    assert departs, f"no shape tells SGLang {version}'s rules from {NEXT[version]}'s"
