"""The load turn: probes sharing a machine's cores hold it one at a time, a turn waited for is
bounded and names its holder, and a holder that dies passes it on."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from kvprobe.errors import ProbeError
from kvprobe.load.turns import TURN_BOOST, TURN_ENV, holder, load_turn, machine_lock


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
