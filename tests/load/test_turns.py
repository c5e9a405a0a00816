"""The load turn: probes sharing a machine's cores hold it one at a time, a turn waited for is
bounded and names its holder, and a holder that dies passes it on."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from kvprobe.errors import ProbeError
from kvprobe.load.turns import (
    QUIET_ENV,
    TURN_BOOST,
    TURN_ENV,
    holder,
    load_turn,
    machine_lock,
    machine_share,
    share_priority,
)
from tests.locks import blocked

pytestmark = pytest.mark.usefixtures("outside_the_suites_timeline")


def test_without_the_variable_there_is_no_turn(monkeypatch):
    monkeypatch.delenv(TURN_ENV, raising=False)
    with load_turn() as waited:
        with load_turn() as again:  # would block on a real turn
            assert (waited, again) == (0.0, 0.0)


def test_a_second_holder_waits_until_the_first_lets_go(tmp_path):
    path = str(tmp_path / "turn")
    order, first_in, release = [], threading.Event(), threading.Event()

    def first():
        with load_turn(path=path):
            order.append("first in")
            first_in.set()
            release.wait(30)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(30)
    said = []

    def waiting(line):  # the first lets go only once the second says it waits
        said.append(line)
        release.set()

    with load_turn(path=path, log=waiting) as waited:
        order.append("second in")
    t.join(30)
    assert order == ["first in", "first out", "second in"]
    assert waited > 0
    assert len(said) == 1 and f"held by pid {os.getpid()}" in said[0], said


def test_a_turn_not_had_in_time_names_the_file_and_its_holder(tmp_path):
    path = str(tmp_path / "turn")
    holder_proc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from kvprobe.load.turns import load_turn\n"
         f"with load_turn(path={path!r}):\n    print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder_proc.stdout.readline().strip() == "held"
        with pytest.raises(ProbeError) as err, load_turn(path=path, wait_seconds=0.3):
            pytest.fail("the turn was had while another process held it")
        assert f"{TURN_ENV}={path}" in str(err.value) and f"held by pid {holder_proc.pid}" in str(err.value)
    finally:
        holder_proc.kill()
        holder_proc.wait(30)
    # the kernel released the dead holder's lock: the turn is had at once
    with load_turn(path=path, wait_seconds=5):
        assert holder(path) == f"pid {os.getpid()}"


def test_the_holder_starts_its_load_above_the_machine_where_it_may_and_gives_it_back(tmp_path):
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, before - 1)
        allowed = True
    except PermissionError:
        allowed = False
    else:
        os.setpriority(os.PRIO_PROCESS, 0, before)
    with load_turn(path=str(tmp_path / "turn")):
        inside = os.getpriority(os.PRIO_PROCESS, 0)
        child = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                               capture_output=True, text=True, timeout=60)
    assert inside == (before - TURN_BOOST if allowed else before)
    assert int(child.stdout) == inside  # the load generator it starts runs at its priority
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_a_client_started_before_the_turn_takes_the_turns_priority(tmp_path):
    """A probe starts its Locust idle, then waits for the turn: had, the client's whole process group
    runs at the holder's priority (boosted where the machine allows it)."""
    client = subprocess.Popen([sys.executable, "-c", "import os, time; os.fork(); time.sleep(60)"],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(_group(client.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        members = _group(client.pid)
        assert len(members) == 2, members  # the client and its fork (Locust's --processes)
        with load_turn(path=str(tmp_path / "turn")):
            inside = os.getpriority(os.PRIO_PROCESS, 0)
            assert share_priority(client.pid)
            assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in members] == [inside, inside]
        assert not share_priority(None)
    finally:
        os.killpg(client.pid, 9)
        client.wait(timeout=30)


def _group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except ProcessLookupError:
                pass
    return sorted(pids)


def test_an_exclusive_holder_waits_for_the_work_beside_it_and_keeps_new_work_out(tmp_path):
    """machine_lock: the exclusive holder waits for the shared one, and holds `.want` while it waits, so
    work arriving meanwhile (a harness starts its next test milliseconds after the last) waits behind it."""
    base = str(tmp_path / "turn")
    order = []
    a_in, a_go = threading.Event(), threading.Event()

    def work(name, exclusive, started=None, go=None):
        with machine_lock(base, exclusive=exclusive, seconds=30) as had:
            assert had
            order.append(f"{name} in")
            if started:
                started.set()
            if go:
                assert go.wait(30)
            order.append(f"{name} out")

    a = threading.Thread(target=work, args=("a", False, a_in, a_go))
    a.start()
    assert a_in.wait(30)
    b = threading.Thread(target=work, args=("alone", True))
    b.start()
    assert _held_within(base + ".want", fcntl.LOCK_SH, seconds=30), "the exclusive holder never asked"
    assert "alone in" not in order, order
    c = threading.Thread(target=work, args=("c", False))
    c.start()
    a_go.set()
    for t in (a, b, c):
        t.join(30)
    assert order == ["a in", "a out", "alone in", "alone out", "c in", "c out"], order


def _held_within(path: str, mode: int, *, seconds: float) -> bool:
    """Does someone hold `path` against `mode` within `seconds` (polled)?"""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            time.sleep(0.01)
            continue
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        time.sleep(0.01)
    return False


def test_a_quiet_probe_shares_the_machine_and_has_it_to_itself_while_it_loads(tmp_path, monkeypatch):
    base = str(tmp_path / "turn")
    quiet = base + ".quiet"
    monkeypatch.setenv(TURN_ENV, base)
    monkeypatch.delenv(QUIET_ENV, raising=False)
    with machine_share() as held:  # not a quiet probe: nothing held, the turn alone
        assert held is False and not blocked(quiet, fcntl.LOCK_EX)
        with load_turn():
            assert not blocked(quiet, fcntl.LOCK_EX) and blocked(base, fcntl.LOCK_EX)
    monkeypatch.setenv(QUIET_ENV, "1")
    with machine_share() as held:
        assert held is True
        assert blocked(quiet, fcntl.LOCK_EX) and not blocked(quiet, fcntl.LOCK_SH)  # its engine starts
        with load_turn():
            assert blocked(quiet, fcntl.LOCK_SH) and blocked(base, fcntl.LOCK_EX)  # alone while it loads
        assert blocked(quiet, fcntl.LOCK_EX) and not blocked(quiet, fcntl.LOCK_SH)  # its drain and stop
    assert not blocked(quiet, fcntl.LOCK_EX)


_QUIET_PROBE = """
import json, os, sys, time
from kvprobe.load.turns import load_turn, machine_lock, machine_share
name, log, base = sys.argv[1], sys.argv[2], os.environ["KVPROBE_LOAD_TURN"]

def note(what):
    with open(log, "a") as f:
        f.write(json.dumps([name, what, time.monotonic()]) + "\\n")

if name.startswith("quiet"):
    with machine_share():
        note("share")
        time.sleep(0.3)  # its engine starting, beside the other's
        with load_turn():
            note("alone in"); time.sleep(0.3); note("alone out")
else:  # another lane's test: the machine shared over it, the turn over its load
    with machine_lock(base, exclusive=False, seconds=30):
        note("lane in"); time.sleep(0.2)
        with load_turn():
            time.sleep(0.2)
        note("lane out")
"""


def test_two_quiet_probes_and_a_lane_test_finish_and_never_load_beside_each_other(tmp_path):
    """Both quiet probes hold the machine shared while they start, then both want it to themselves:
    neither keeps its shared hold while it waits (or they would wait for each other for good), and
    no quiet probe loads while another holds the machine."""
    log = tmp_path / "log"
    env = {**os.environ, TURN_ENV: str(tmp_path / "turn"), QUIET_ENV: "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _QUIET_PROBE, name, str(log)], env=env)
             for name in ("quiet-a", "quiet-b", "lane")]
    try:
        assert [p.wait(60) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
    notes = [json.loads(line) for line in log.read_text().splitlines()]
    alone = {name: [t for n, what, t in notes if n == name and what.startswith("alone")] for name in ("quiet-a",
                                                                                                      "quiet-b")}
    lane = [t for n, what, t in notes if n == "lane"]
    shares = [t for n, what, t in notes if what == "share"]
    assert all(len(span) == 2 for span in alone.values()) and len(lane) == 2, notes
    spans = sorted([*alone.values(), lane])
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans  # one after another
    for start, end in alone.values():  # no probe's engine started while another had the machine
        assert not [t for t in shares if start < t < end], notes
