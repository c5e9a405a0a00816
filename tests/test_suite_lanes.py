"""How `make test` shares two cores (tests/conftest.py): which modules run in a lane and which share
the cores at the lower priority. A wrong entry here would put a probe beside another, or leave a
renamed module in a lane nobody meant."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from tests import conftest
from tests.locks import blocked

ROOT = Path(__file__).resolve().parents[1]
# how a test starts load: a probe (in-process, by the CLI, by the plugin) or Locust itself
LOAD_SIGNS = ("run_probe", "LocustRun", '"probe"', "--kvprobe", "import ramp", "kvprobe.load.runner")


pytestmark = pytest.mark.usefixtures("outside_the_suites_timeline")  # the hooks below log holds


@pytest.fixture(autouse=True)
def _fresh_lanes():
    # the lanes are cached per module and read KVPROBE_TEST_LANES once: each test reads them afresh,
    # and leaves no entry of its own environment behind for this worker's scheduling of priorities
    conftest._module_lane.cache_clear()
    yield
    conftest._module_lane.cache_clear()


@pytest.mark.parametrize("path", sorted(conftest.SHARES_THE_CORES))
def test_every_module_that_shares_the_cores_exists_and_drives_no_load(path):
    text = (ROOT / path).read_text(encoding="utf-8")
    # a module that starts Locust or a probe belongs in a lane: its client's lag is judged
    found = [sign for sign in LOAD_SIGNS if sign in text]
    assert not found, f"{path} drives load ({found}): it belongs in a lane"


def _lane(lanes: int, k: int) -> str:
    return conftest.LAYOUTS[lanes][k][0]


@pytest.mark.parametrize(("lanes", "nodeid", "k"), [
    (2, "tests/shadow/test_vllm_e2e.py::test_x", 1),
    (2, "tests/shadow_sglang/test_shared_radix.py::test_x", 0),
    (2, "tests/probe/test_probe_e2e.py::test_x[a]", 0),
    (2, "tests/load/test_load_run.py::test_x", 1),
    (2, "tests/fleet/test_fleet_e2e.py::test_x", 1),
    (2, "tests/shadow_env/test_hybrid_vllm_probe.py::test_x", 1),  # no sign needed
    (3, "tests/shadow/test_vllm_e2e.py::test_x", 0),
    (3, "tests/shadow_env/test_hybrid_vllm_probe.py::test_x", 0),
    (3, "tests/shadow_sglang/test_shared_radix.py::test_x", 1),
    (3, "tests/probe/test_probe_e2e.py::test_x[a]", 2),
    (3, "tests/load/test_load_run.py::test_x", 1),
    (3, "tests/hardening/test_faults.py::test_x", 2),
    (3, "tests/fleet/test_fleet_e2e.py::test_x", 1),
    (3, "tests/plugin/test_plugin.py::test_x", 0),
    *((lanes, nodeid, None) for lanes in (2, 3) for nodeid in (
        "tests/theory/test_real_vllm.py::test_x",  # named in SHARES_THE_CORES
        "tests/shadow/test_vllm_planner.py::test_x",  # under ENGINE_DIRS, but named
        "tests/test_spec.py::test_x")),  # no sign
])
def test_lanes_by_module(lanes, nodeid, k, monkeypatch):
    monkeypatch.setenv("KVPROBE_TEST_LANES", str(lanes))
    assert conftest.lane(ROOT, nodeid) == (None if k is None else _lane(lanes, k))
    assert conftest.serial(ROOT, nodeid) is (k is not None)


def test_one_lane_by_default(monkeypatch):
    monkeypatch.delenv("KVPROBE_TEST_LANES", raising=False)
    assert conftest.lane(ROOT, "tests/probe/test_probe_e2e.py::t") == _lane(1, 0)
    assert conftest.lane(ROOT, "tests/shadow_sglang/test_repro.py::t") == _lane(1, 0)


@pytest.mark.parametrize("raw", ["4", "two", ""])
def test_a_lane_count_without_a_layout_is_a_usage_error(raw, monkeypatch):
    monkeypatch.setenv("KVPROBE_TEST_LANES", raw)
    with pytest.raises(pytest.UsageError, match=f"KVPROBE_TEST_LANES={raw!r}: expected one of \\[1, 2, 3\\]"):
        conftest.lane(ROOT, "tests/probe/test_probe_e2e.py::t")


def _nodeids_in_run_order(monkeypatch, pytestconfig, lanes: str, collected: list[str]) -> list[str]:
    monkeypatch.setenv("KVPROBE_TEST_LANES", lanes)
    conftest._module_lane.cache_clear()  # the lanes of the count asked for
    items = [_Item(pytestconfig, nodeid, quiet=False) for nodeid in collected]
    conftest.pytest_collection_modifyitems(pytestconfig, items)
    return [item.nodeid for item in items]


# node ids as pytest collects them; tests/probe/test_bench_bar.py is in no lane
COLLECTED = ["tests/cli/test_declared_flags.py::a", "tests/fleet/test_fleet_e2e.py::q", "tests/probe/test_diff.py::a",
             "tests/probe/test_diff.py::b", "tests/probe/test_bench_bar.py::a", "tests/shadow/test_vllm_e2e.py::a",
             "tests/shadow/test_vllm_e2e.py::q", "tests/shadow/test_vllm_release_pair.py::a",
             "tests/shadow_sglang/test_attach_checks.py::a", "tests/shadow_sglang/test_repro.py::a",
             "tests/target/test_launcher.py::a", "tests/test_spec.py::a"]


def test_each_lane_runs_its_engines_apart_from_the_others(monkeypatch, pytestconfig):
    # the second lane's real engines first, the first lane's last; each kind in its files' order, a module
    # whole, every test outside the lanes in its place
    assert _nodeids_in_run_order(monkeypatch, pytestconfig, "2", COLLECTED) == [
        "tests/cli/test_declared_flags.py::a", "tests/fleet/test_fleet_e2e.py::q",
        "tests/shadow_sglang/test_attach_checks.py::a", "tests/shadow_sglang/test_repro.py::a",
        "tests/probe/test_bench_bar.py::a", "tests/target/test_launcher.py::a",
        "tests/shadow/test_vllm_e2e.py::a", "tests/shadow/test_vllm_e2e.py::q",
        "tests/probe/test_diff.py::a", "tests/probe/test_diff.py::b", "tests/shadow/test_vllm_release_pair.py::a",
        "tests/test_spec.py::a"]
    # three lanes: each its real engines first (the SGLang lane's fleet module after them)
    assert _nodeids_in_run_order(monkeypatch, pytestconfig, "3", COLLECTED) == [
        "tests/cli/test_declared_flags.py::a", "tests/shadow_sglang/test_attach_checks.py::a",
        "tests/probe/test_diff.py::a", "tests/probe/test_diff.py::b", "tests/probe/test_bench_bar.py::a",
        "tests/shadow/test_vllm_e2e.py::a", "tests/shadow/test_vllm_e2e.py::q",
        "tests/shadow/test_vllm_release_pair.py::a", "tests/shadow_sglang/test_repro.py::a",
        "tests/fleet/test_fleet_e2e.py::q", "tests/target/test_launcher.py::a", "tests/test_spec.py::a"]
    one_lane = _nodeids_in_run_order(monkeypatch, pytestconfig, "1", COLLECTED)
    assert one_lane == COLLECTED  # one lane: as collected


PROBE_SIGNS = ("run_probe", '"probe"', "--kvprobe", '"diff"', "repro_chain")
LOAD_SIGNS = ("LocustRun(", "STALL_ENV", "burn")  # load on the machine beside any probe


@pytest.mark.parametrize("path", conftest.PROBES_TAKE_TURNS)
def test_every_module_whose_probes_take_turns_runs_probes_in_a_lane(path):
    # a module named here holds no turn of its own: its load must come from probes, which take one
    text = (ROOT / path).read_text(encoding="utf-8")
    assert [sign for sign in PROBE_SIGNS if sign in text], f"{path} runs no probe: its load would take no turn"
    assert conftest.serial(ROOT, f"{path}::t"), f"{path} is in no lane: it needs no turn"
    assert not [sign for sign in LOAD_SIGNS if sign in text], \
        f"{path} loads the machine outside its probes: it must hold the turn throughout"


@pytest.mark.parametrize("path", sorted(conftest.WAITS_WITHOUT_LOAD))
def test_every_module_that_waits_without_load_drives_none(path):
    # a module named here holds no turn at all: neither a probe nor a load generator may run in it
    text = (ROOT / path).read_text(encoding="utf-8")
    assert not [sign for sign in (*PROBE_SIGNS, *LOAD_SIGNS) if sign in text], \
        f"{path} drives load: it must take the turn"
    assert conftest.serial(ROOT, f"{path}::t"), f"{path} is in no lane: it needs no entry here"
    assert path not in conftest.PROBES_TAKE_TURNS


class _Item:
    """What the protocol hook and the turn's fixture read of a pytest item."""

    def __init__(self, config, nodeid: str, quiet: bool, holds: bool = False):
        self.config, self.nodeid, self.stash = config, nodeid, pytest.Stash()
        self._marks = {"needs_a_quiet_machine"} if quiet else set()
        if holds:
            self._marks.add("holds_the_turn")

    def get_closest_marker(self, name):
        return object() if name in self._marks else None


@pytest.mark.parametrize(("nodeid", "quiet", "holds", "mode"), [
    ("tests/shadow/test_vllm_e2e.py::test_x", True, False, "probes"),  # each the machine to itself too
    ("tests/shadow/test_vllm_e2e.py::test_x", False, False, "probes"),
    ("tests/probe/test_probe_e2e.py::test_x", False, True, "whole"),
    ("tests/load/test_load_run.py::test_x", False, False, "whole"),  # Locust of its own
    ("tests/emulator/test_sglang_idle_gauges.py::test_x", False, False, None),  # waits without load
    ("tests/test_spec.py::test_x", False, False, None),  # no lane
])
def test_how_a_lane_test_takes_the_turn(nodeid, quiet, holds, mode, tmp_path, monkeypatch, pytestconfig):
    monkeypatch.setenv("KVPROBE_TEST_LANES", "2")
    monkeypatch.setenv(conftest.TURN_ENV, str(tmp_path / "turn"))
    assert conftest.turn_mode(_Item(pytestconfig, nodeid, quiet, holds)) == mode
    monkeypatch.delenv(conftest.TURN_ENV)
    assert conftest.turn_mode(_Item(pytestconfig, nodeid, quiet, holds)) is None  # one lane: no turn


def _quiet_lock_held(tmp_path, mode) -> bool:
    return blocked(str(tmp_path / "turn.quiet"), mode)


@pytest.mark.parametrize(("nodeid", "quiet", "blocks_shared", "blocks_exclusive"), [
    ("tests/shadow_sglang/test_usage_gauge.py::test_x", False, False, True),
    ("tests/shadow/test_vllm_e2e.py::test_x", True, False, False),  # its probes hold it (kvprobe.load.turns)
    ("tests/theory/test_ledger.py::test_x", False, False, False),  # no lane: no lock
])
def test_the_machine_lock_spans_the_whole_protocol(nodeid, quiet, blocks_shared, blocks_exclusive,
                                                  tmp_path, monkeypatch, pytestconfig):
    """Held shared from before the item's setup (a module's server fixture starts there) to after its
    teardown; a quiet test's probes take it themselves."""
    monkeypatch.setenv("KVPROBE_TEST_LANES", "2")
    monkeypatch.setenv(conftest.TURN_ENV, str(tmp_path / "turn"))
    hook = conftest.pytest_runtest_protocol(_Item(pytestconfig, nodeid, quiet), None)
    next(hook)  # the protocol (setup, call, teardown) runs here
    assert _quiet_lock_held(tmp_path, fcntl.LOCK_SH) == blocks_shared
    assert _quiet_lock_held(tmp_path, fcntl.LOCK_EX) == blocks_exclusive
    with pytest.raises(StopIteration):
        next(hook)
    assert not _quiet_lock_held(tmp_path, fcntl.LOCK_EX)


@pytest.mark.parametrize("phase", [
    pytest.param(lambda item: conftest.pytest_runtest_setup(item), id="setup"),
    pytest.param(lambda item: conftest.pytest_runtest_teardown(item, None), id="teardown"),
])
@pytest.mark.parametrize(("nodeid", "quiet", "held"), [
    ("tests/shadow/test_vllm_e2e.py::test_x", True, True),  # a module's engine may start or stop there
    ("tests/shadow/test_vllm_e2e.py::test_x", False, False),  # its protocol's hold covers it already
    ("tests/theory/test_ledger.py::test_x", True, False),  # no lane
])
def test_a_quiet_tests_setup_and_teardown_share_the_machine(phase, nodeid, quiet, held, tmp_path, monkeypatch,
                                                            pytestconfig):
    monkeypatch.setenv("KVPROBE_TEST_LANES", "2")
    monkeypatch.setenv(conftest.TURN_ENV, str(tmp_path / "turn"))
    item = _Item(pytestconfig, nodeid, quiet)
    hook = phase(item)
    next(hook)
    assert _quiet_lock_held(tmp_path, fcntl.LOCK_EX) == held
    assert not _quiet_lock_held(tmp_path, fcntl.LOCK_SH)
    with pytest.raises(StopIteration):
        next(hook)
    assert not _quiet_lock_held(tmp_path, fcntl.LOCK_EX)


def test_every_quiet_test_loads_through_its_probes():
    # a quiet test has the machine to itself only while its probes load (kvprobe.load.turns
    # machine_share): load of its own would run beside the other lane's engines starting
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                    if "mark.needs_a_quiet_machine" in p.read_text(encoding="utf-8") and p != Path(__file__))
    assert "tests/shadow/test_vllm_e2e.py" in marked and "tests/fleet/test_fleet_e2e.py" in marked
    assert [p for p in marked if p not in conftest.PROBES_TAKE_TURNS] == []


def test_a_quiet_setup_that_cannot_share_the_machine_fails_its_test(tmp_path, monkeypatch, pytestconfig):
    monkeypatch.setenv("KVPROBE_TEST_LANES", "2")
    monkeypatch.setenv(conftest.TURN_ENV, str(tmp_path / "turn"))
    monkeypatch.setattr(conftest, "QUIET_WAIT_SECONDS", 0.2)
    item = _Item(pytestconfig, "tests/shadow/test_vllm_e2e.py::test_x", quiet=True)
    with conftest.machine_lock(str(tmp_path / "turn"), exclusive=True, seconds=5) as had:  # another's, alone
        assert had
        hook = conftest.pytest_runtest_setup(item)
        next(hook)
        with pytest.raises(StopIteration):
            next(hook)
    assert "waited 0.2 s for the lanes' quiet lock" in item.stash[conftest._QUIET_MISSED]
