"""The suite's shared plumbing: pytester, the measured figures the engine-bound tests print, and how
the suite shares two cores when it runs on pytest-xdist workers (`make test`).

The end-to-end tests — the real engines' (modules under ENGINE_DIRS) and those that drive kvprobe's
emulator or read the clock (a module with a SERIAL_SIGN: servers and Locust, a deadline, a bound on
how long something took) — run in a lane: one unit of work, its tests one after another on one
worker, at full priority. The other tests (unit tests: no load, no clock) run on another worker at a
lower CPU priority (nice 10), so a probe's engine and client still get the cores when they need
them. SHARES_THE_CORES names the modules whose directory or signs would put them in the lane but
that neither drive load nor judge time.

`make test` runs two lanes side by side (KVPROBE_TEST_LANES=2, `-n 3`; LAYOUTS says which modules
each lane runs, and has a layout of three, `-n 4`) and they take turns at loading the machine: a probe
judges its own client's lag and calls a level inconclusive when it lags, and two probes ramping at
once on two cores starved each other's Locust client (loop lag p99 18-28 ms against the 15 ms a probe
accepts). So the lanes share one load
turn (kvprobe.load.turns): a probe of a module in PROBES_TAKE_TURNS holds it from its calibration to
its load's stop, and every other lane test (and one marked `holds_the_turn`: it bounds the wall
clock around its probe, which a wait for the turn would spend) holds it throughout, but for those
that drive no load at all (WAITS_WITHOUT_LOAD); the other lanes' engines start and drain meanwhile.
A test marked `needs_a_quiet_machine` (a real server streaming requests of a second or two: an
engine starting beside it makes it burst) has its probes load while the other lanes run nothing;
its engines start beside the other lanes' loads.
Without KVPROBE_TEST_LANES one lane holds every end-to-end test and no turn is
taken; on one worker the suite is the same tests in the same order.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from kvprobe.load.turns import QUIET_ENV, TURN_ENV, TURN_LOG_ENV, load_turn, log_hold, machine_lock
from tests import suite_timeline

pytest_plugins = ["pytester"]

ENGINE_DIRS = ("tests/shadow/", "tests/shadow_sglang/", "tests/shadow_env/")
# The lanes of KVPROBE_TEST_LANES=N: each a name, the directories whose modules it runs (the last
# lane: every other lane module) and whether its real engines' modules (ENGINE_DIRS) run first. Two in
# `make test`. Three: each engine's real servers in a lane of their own, then emulator modules; the
# third lane the emulator's alone, so that one lane's probes load while the others start their engines.
# Not the default: of four clean clones with three lanes (26.6-28.7 min; each probe's Locust started
# idle before its turn, since taken back), the last failed two SGLang shadow probes on their client's
# lag (19.1 ms > 16.7 at N=7, held on 15 s past the burst; a quiet probe's 19.2 ms > 17.7).
# (With the emulator's modules all in the third lane, a clean clone's engine lanes ended 7 min before
# it: 28.7 min, the turn held 24.3; the vLLM lane ran 917 s of tests, the SGLang lane 984 and the third
# 1,094, and waited the longest for the turn: its many short probes each take it afresh. With
# tests/plugin/ after the vLLM engines and tests/fleet/ after SGLang's, 27.5 min: the lanes ended at
# 23.8, 20.2 and 27.5 min; with tests/load/ (4.2 min of the third lane's span) moved to the SGLang lane,
# 26.6 min, the lanes ending at 26.6, 25.4 and 24.7 min.)
# With two lanes, the vLLM shadow with the emulator's modules and the SGLang shadow with tests/probe/,
# a clean clone spent 28.8 min: the turn held 23.7, idle 4.1 in gaps of 4-35 s while both lanes started
# engines at once. The SGLang lane runs its real engines first, the other lane last: while one lane's
# engines start (no load: the turn idle unless the other lane loads) the other lane's probes load.
# With both lanes running their engines last, a clean clone left the turn idle 235 s in the 964 s both
# lanes spent starting real engines side by side (27.6 min; 26.9 with this order, the idle turn 184 s).
# (Two lanes' history: tests/load/ in the second lane balanced the spans and lengthened the wall: 28.3
# min against 27.2, the first lane waiting 7.1 min for the turn, not 5.3. A lane's modules take longer
# the more of the turn the other lanes hold, so a move shifts more than its own span.) On 2026-12-06, with
# shorter shadow probes, the vLLM lane ended 1.9 min after the SGLang lane (24.8 min), starting its last
# engines with nothing to load beside them: tests/workers/ (0.5 min) moved to the end of the SGLang lane.
# The lanes then ended at 24.5 and 24.1 min and the wall stayed at 24.8: both are bound by the turn.
LAYOUTS = {
    1: (("end-to-end", (), False),),
    2: (("end-to-end: SGLang shadow, probes, workers",
         ("tests/shadow_sglang/", "tests/probe/", "tests/workers/"), True),
        ("end-to-end: vLLM shadow, emulator", (), False)),
    3: (("end-to-end: vLLM shadow, plugin", ("tests/shadow/", "tests/shadow_env/", "tests/plugin/"), True),
        ("end-to-end: SGLang shadow, fleet, load", ("tests/shadow_sglang/", "tests/fleet/", "tests/load/"), True),
        ("end-to-end: emulator", (), True)),
}
# a module that marks a test slow, or reads or waits on the clock (a bound on how long something
# took, a deadline), runs in a lane: none of its tests shares its worker with a probe
SERIAL_SIGNS = ("mark.slow", "time.monotonic", "time.time(", "time.sleep", "wait_for(", "timeout=")
# Modules a lane would take by their directory or a sign but that only compute: the engines' own code
# run in a subprocess, or a CLI, with a deadline minutes above what the work takes at any priority.
SHARES_THE_CORES = {
    "tests/theory/test_real_sglang.py": "SGLang's scheduler run step by step in its env (900 s deadline)",
    "tests/theory/test_real_vllm.py": "vLLM's scheduler run step by step in its env (900 s deadline)",
    "tests/theory/test_real_vllm_first_chunk.py": "vLLM 0.18.1's and 0.33.0's first-chunk schedulers in their envs",
    "tests/theory/test_real_vllm_hybrid.py": "vLLM's hybrid scheduler step by step in its env (900 s deadline)",
    "tests/shadow/test_vllm_planner.py": "vLLM's KV planner on the worker's specs, no server",
    "tests/shadow/test_vllm_target.py": "the shadow command line and settings, no server",
    "tests/shadow_env/test_envs.py": "environment bookkeeping on a fake recipe",
    "tests/shadow_env/test_prune.py": "environment bookkeeping on fake folders",
    "tests/shadow_env/test_sglang_recipes.py": "the recipes' text",
    "tests/shadow_env/test_hybrid_vllm.py": "vLLM's config resolution and planner in its env, no server",
    "tests/shadow_env/test_hybrid_vllm_worker.py": "vLLM's planner on the worker's hybrid specs, no server",
    "tests/shadow_env/test_mla_vllm_releases.py": "vLLM 0.18.1's planner on the worker's MLA specs, no server",
    "tests/shadow_env/test_hybrid_sglang.py": "SGLang's pool sizing in its env, no server",
    "tests/shadow_env/test_modeldir.py": "transformers loading the model folder in the env (300 s deadline)",
    "tests/shadow_sglang/test_units.py": "SGLang's hook functions in-process",
    "tests/shadow_sglang/test_hybrid_units.py": "SGLang's hybrid pools in-process",
    "tests/shadow_sglang/test_env.py": "imports in the env (300 s deadline)",
    "tests/test_house.py": "every module imported in a fresh interpreter (120 s deadline)",
    "tests/test_cmd_ledger.py": "the ledger CLI (60 s deadline)",
    "tests/test_engine_figures.py": "capacity lines from recorded logs",
    "tests/test_spec_first_run.py": "the CLI refusing or writing a first spec (60 s deadline)",
}
# Lane modules whose load comes only from kvprobe's probes (in-process, or a console or pytest
# subprocess that inherits the environment): with two lanes each probe holds the machine's load turn
# (kvprobe.load.turns) from its calibration to its load's stop, so the other lane's engines start
# while it ramps. Every other lane test holds the turn from its setup to its teardown.
PROBES_TAKE_TURNS = (
    "tests/cli/test_declared_flags.py", "tests/fleet/test_fleet_e2e.py", "tests/hardening/test_secrets.py",
    "tests/plugin/test_plugin.py", "tests/plugin/test_plugin_attach.py", "tests/plugin/test_plugin_bad_input.py",
    "tests/plugin/test_plugin_outcomes.py", "tests/plugin/test_plugin_versions.py", "tests/probe/test_attach_e2e.py",
    "tests/probe/test_diff.py", "tests/probe/test_measurement_e2e.py", "tests/probe/test_predict_ramp_e2e.py",
    "tests/probe/test_probe_e2e.py", "tests/shadow/test_repro_vllm.py", "tests/shadow/test_vllm_e2e.py",
    "tests/shadow/test_vllm_release_pair.py", "tests/shadow/test_vllm_staging.py",
    "tests/shadow_env/test_hybrid_vllm_probe.py", "tests/shadow_sglang/test_attach_checks.py",
    "tests/shadow_sglang/test_console_probe.py", "tests/shadow_sglang/test_declared_gpu.py",
    "tests/shadow_sglang/test_hybrid_shadow.py", "tests/shadow_sglang/test_repro.py",
    "tests/shadow_sglang/test_shared_no_radix.py", "tests/shadow_sglang/test_shared_radix.py",
    "tests/shadow_sglang/test_usage_gauge.py",
)
# Lane tests that drive no load (no probe, no Locust): they wait on the engine's own timers, or start an
# engine that exits, as every lane's engines start beside the other lane's ramp. They keep their lane
# (a deadline or a bound on how long something took) and hold no turn: the other lane ramps meanwhile.
WAITS_WITHOUT_LOAD = {
    "tests/emulator/test_sglang_idle_gauges.py": "two streams, then ~35 s waiting for SGLang's idle report",
    "tests/shadow_sglang/test_bad_input.py": "SGLang's start-up refusals and an engine exiting during start-up",
}
YIELDING_NICE = 10  # the priority of the tests outside the lanes
FIGURES = "measured figures"  # the user_properties key a test's figure lines travel under
_reported: list[tuple[str, str]] = []


@functools.cache
def _module_lane(root: Path, path: str) -> str | None:
    if path in SHARES_THE_CORES:
        return None
    if not path.startswith(ENGINE_DIRS):
        try:
            text = (root / path).read_text(encoding="utf-8")
        except OSError:
            return None
        if not any(sign in text for sign in SERIAL_SIGNS):
            return None
    layout = LAYOUTS[lane_count()]
    return next((name for name, dirs, _ in layout if dirs and path.startswith(dirs)), layout[-1][0])


def lane(root: Path, nodeid: str) -> str | None:
    """The lane the test `nodeid` (relative to `root`) runs in, or None when it shares the cores."""
    return _module_lane(root, nodeid.split("::", 1)[0])


def serial(root: Path, nodeid: str) -> bool:
    """Does the test `nodeid` run in a lane?"""
    return lane(root, nodeid) is not None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with each lane one group, found by module. (xdist's own xdist_group marks
    rename node ids, which pytest 9 no longer lets a plugin do.) xdist hands out the largest unit
    first (--loadscope-reorder, its default): the lanes, one to each worker."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class EndToEndGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(root, nodeid) or nodeid

    return EndToEndGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """With lanes, each lane's tests in the order `_run_order` gives (its engines first or last); every other
    test keeps its place. (xdist hands a lane out in collection order, which every worker computes
    alike.)"""
    if lane_count() < 2:
        return
    root = config.rootpath
    for name, _, engines_first in LAYOUTS[lane_count()]:
        at = [i for i, item in enumerate(items) if lane(root, item.nodeid) == name]
        # a stable sort: the files of each kind keep their order, and the lane its places in the collection
        moved = iter(sorted((items[i] for i in at), key=lambda item: _run_order(engines_first, item.nodeid)))
        for i in at:
            items[i] = next(moved)


def _run_order(engines_first: bool, nodeid: str) -> int:
    """Where a lane runs the test `nodeid`: its real engines' modules first or last."""
    engine = nodeid.startswith(ENGINE_DIRS)
    return int(not engine) if engines_first else int(engine)


def lane_count() -> int:
    """KVPROBE_TEST_LANES: how many lanes run side by side (1 without it)."""
    raw = os.environ.get("KVPROBE_TEST_LANES", "1")
    if not raw.isdigit() or int(raw) not in LAYOUTS:
        raise pytest.UsageError(f"KVPROBE_TEST_LANES={raw!r}: expected one of {sorted(LAYOUTS)}")
    return int(raw)


_STARTED = time.time()  # the controller's start: the wall clock the timeline's lines divide


def pytest_configure(config):
    # A suite started in the background of a non-interactive shell inherits SIGINT ignored, and every
    # process it starts with it: the Ctrl-C tests would find kvprobe deaf to SIGINT (a clean clone
    # started `( setsid bash -c "make test" & )` failed three of them). Python's own handler, set here,
    # is the default again in every child.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # the controller names the turn's file (and the log of its holds) before its workers start; they inherit it
    if lane_count() > 1 and not os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get(TURN_ENV):
        os.environ[TURN_ENV] = str(Path(tempfile.gettempdir()) / f"kvprobe-load-turn-{os.getpid()}")
        os.environ[TURN_LOG_ENV] = os.environ[TURN_ENV] + ".log"
        for suffix in ("", ".quiet", ".want", ".log"):
            config.add_cleanup(lambda path=os.environ[TURN_ENV] + suffix: Path(path).unlink(missing_ok=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Every lane test holds the machine lock shared over its whole protocol, not only its function: a
    # module's engine (a module-scoped server fixture) starts in its first test's setup and stops in
    # its last one's teardown, before and after any function fixture. Held from a fixture, it let the
    # other lane start two SGLang shadows while a quiet test ramped (CI: loop lag 20.4 ms at N=37).
    # A quiet test holds it shared over its setup and teardown (below), and its probes hold it
    # themselves (kvprobe.load.turns.machine_share, with QUIET_ENV): shared from their launch to their
    # close, exclusively from their calibration to their load's stop. (Held exclusively by the test
    # over its whole protocol, each quiet test's engine started on an idle machine, and the lane
    # before it finished its test, engine start included, on an idle one: 3.9 min of a 29.1-min run
    # with one lane alone, 4.0 with the turn idle. Held by its probes alone, exclusively, with no
    # shared hold over their engine's start, a quiet test of the other lane started its vLLM shadow
    # beside an SGLang hybrid probe: loop lag 16.3 ms > 16.1 ms in a clean clone.)
    if not os.environ.get(TURN_ENV) or not serial(item.config.rootpath, item.nodeid):
        yield
        return
    quiet = _quiet(item)
    asked = time.time()
    with contextlib.nullcontext() if quiet else _machine_shared(item):
        start = time.time()
        yield
    # the lane test's span, for the run's timeline (its probes log their time alone themselves)
    log_hold("lane", start, time.time(), start - asked, who=item.nodeid)


def _quiet(item) -> bool:
    return item.get_closest_marker("needs_a_quiet_machine") is not None


@contextlib.contextmanager
def _machine_shared(item):
    """The lanes' machine lock, shared; not had within QUIET_WAIT_SECONDS, the test is marked to fail
    (_load_turn) and runs its hook without it."""
    with machine_lock(os.environ[TURN_ENV], exclusive=False, seconds=QUIET_WAIT_SECONDS) as had:
        if not had:
            item.stash[_QUIET_MISSED] = f"waited {QUIET_WAIT_SECONDS} s for the lanes' quiet lock"
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # a quiet test's teardown (a module's engine stops there) shares the machine as every lane test does
    with _machine_shared(item) if _quiet_in_a_lane(item) else contextlib.nullcontext():
        yield


def _quiet_in_a_lane(item) -> bool:
    return bool(os.environ.get(TURN_ENV)) and serial(item.config.rootpath, item.nodeid) and _quiet(item)


_QUIET_MISSED = pytest.StashKey[str]()


def turn_mode(item) -> str | None:
    """How a lane test takes the load turn: "whole" (held from its setup to its teardown; its probes
    take none), "probes" (each of its probes holds it while it loads; a quiet test's, the machine to
    itself too), None (it drives no load, or runs in no lane)."""
    path = item.nodeid.split("::", 1)[0]
    if not os.environ.get(TURN_ENV) or not serial(item.config.rootpath, item.nodeid):
        return None
    if _quiet(item):
        return "probes"
    if item.get_closest_marker("holds_the_turn") is not None:
        return "whole"
    if path in WAITS_WITHOUT_LOAD:
        return None
    return "probes" if path in PROBES_TAKE_TURNS else "whole"


@pytest.fixture(autouse=True)
def _load_turn(request, monkeypatch):
    """A lane test whose load is not only its probes' holds the load turn throughout (and its
    probes, inside it, take none). Its machine lock (pytest_runtest_protocol) is held by then,
    shared; a test marked `needs_a_quiet_machine` has its probes take the machine to themselves
    (QUIET_ENV: they hold it shared from their launch, so the other lane's quiet probes wait for
    their engine to start, and exclusively while they load, so the other lane finishes its test and
    waits)."""
    if _QUIET_MISSED in request.node.stash:
        pytest.fail(request.node.stash[_QUIET_MISSED])
    mode = turn_mode(request.node)
    if mode == "probes" and _quiet(request.node):
        monkeypatch.setenv(QUIET_ENV, "1")
    with load_turn() if mode == "whole" else contextlib.nullcontext():
        if mode == "whole":
            monkeypatch.delenv(TURN_ENV)
        yield


QUIET_WAIT_SECONDS = 1800  # the other lane's longest test (the vLLM repro chain: under 4 minutes) and more


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    # a worker's unit tests yield the cores to the lanes running beside them (the priority holds
    # for the rest of the worker's life: a lane, handed out first, has run on its worker before
    # any other test there)
    if os.environ.get("PYTEST_XDIST_WORKER") and not serial(item.config.rootpath, item.nodeid):
        if os.getpriority(os.PRIO_PROCESS, 0) < YIELDING_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, YIELDING_NICE)
    # a quiet test's setup (a module's engine may start there) shares the machine as every lane test
    # does; not had in time, the test fails as one whose protocol's hold was not (_load_turn)
    with _machine_shared(item) if _quiet_in_a_lane(item) else contextlib.nullcontext():
        yield


@pytest.fixture
def outside_the_suites_timeline(monkeypatch):
    """For tests that take the turn or run the lane hooks on files of their own: their holds are not the
    suite's, and its timeline (tests/suite_timeline.py) would count them."""
    monkeypatch.delenv(TURN_LOG_ENV, raising=False)


def add_figure(node: pytest.Item, line: str) -> None:
    """A figure line of `node`'s test: in the run's summary (from any worker), as well as wherever
    the test printed it."""
    node.user_properties.append((FIGURES, line))


def pytest_runtest_logreport(report):
    # the teardown report carries every line the test added; with xdist it reaches the controller
    if report.when == "teardown":
        _reported.extend((report.nodeid, value) for key, value in report.user_properties if key == FIGURES)


def pytest_terminal_summary(terminalreporter):
    log = os.environ.get(TURN_LOG_ENV)
    if log and not os.environ.get("PYTEST_XDIST_WORKER"):
        lines = suite_timeline.summary(suite_timeline.read_holds(Path(log)), time.time() - _STARTED)
        if lines:
            terminalreporter.write_sep("=", "where the wall clock went (tests/suite_timeline.py)")
            for line in lines:
                terminalreporter.write_line(line)
    if not _reported:
        return
    terminalreporter.write_sep("=", "measured figures")
    last = None
    for nodeid, line in _reported:
        if nodeid != last:
            terminalreporter.write_line(f"{nodeid}:")
            last = nodeid
        for part in line.strip("\n").splitlines():
            terminalreporter.write_line(f"  {part}")
