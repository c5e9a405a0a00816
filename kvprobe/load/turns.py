"""Probes that share a machine's cores take turns at loading it.

A probe judges its own client (a Locust loop that lags makes a level inconclusive) and times a
request alone before it ramps; a second probe ramping on the same cores spoils both. With
KVPROBE_LOAD_TURN naming a lock file, a probe holds that file's lock from its calibration to the
moment its load stops: its engine starts and its drain is watched outside the turn, so another
probe's engine can start while this one ramps. Unset (the default), a probe never waits.

While it holds the turn a probe runs its load generator TURN_BOOST nice levels above the rest of
the machine, where it may (root or CAP_SYS_NICE): an engine starting for the next turn takes up to
two cores for its imports, and a client that loses them lags and makes its own levels inconclusive.
A probe starts that client idle before it waits for the turn (a second or two of imports the turn
need not wait for) and gives it the turn's priority when the turn is had (`share_priority`).
The lock is an advisory `flock` on the file, released by the kernel if its holder dies; a turn
waited for is bounded (TURN_WAIT_SECONDS) and the error names the file and the holder.

A harness that must keep other work from starting beside a test (its engines, say) holds the lock
beside the turn's file (`machine_lock`): shared by every piece of work, exclusively by the one that
needs the machine to itself. A probe that needs it to itself while it loads (requests so short that
an engine starting beside it lags its client: KVPROBE_LOAD_TURN_QUIET=1 beside the turn) holds that
lock shared from its launch to its close (`machine_share`: no such probe of another lane ramps beside
its engine starting), and exclusively over its turn; its engine starts beside the others' loads.

With KVPROBE_LOAD_TURN_LOG naming a file, every hold appends one JSON line (`log_hold`): when it was
had and let go, how long it was waited for, and by whom. The suite reads it to say where its wall
clock went (tests/suite_timeline.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvprobe.errors import ProbeError

TURN_ENV = "KVPROBE_LOAD_TURN"
TURN_LOG_ENV = "KVPROBE_LOAD_TURN_LOG"
QUIET_ENV = "KVPROBE_LOAD_TURN_QUIET"
# The longest another probe's load phase lasts: its profile's budget (the shipped ones: at most
# 10 minutes) and Locust's stop. A turn not had by then is a holder that hangs.
TURN_WAIT_SECONDS = 1200.0
TURN_BOOST = 5  # nice levels: a weight of about 3:1 over a process at the machine's own priority
_POLL_SECONDS = 0.1
_shared: list[int] = []  # the machine lock's descriptor a quiet probe holds shared (machine_share)


@contextmanager
def load_turn(*, log: Callable[[str], None] | None = None, path: str | None = None,
              wait_seconds: float = TURN_WAIT_SECONDS) -> Iterator[float]:
    """Hold the load turn (the lock file `path`, or $KVPROBE_LOAD_TURN; none: no turn) while the
    block runs, and the machine to itself too inside `machine_share`; yields the seconds waited."""
    path = path if path is not None else os.environ.get(TURN_ENV)
    if not path:
        yield 0.0
        return
    with _alone(path, log=log, wait_seconds=wait_seconds) as alone:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            waited = alone + _acquire(fd, path, log=log, wait_seconds=wait_seconds)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                before = _boost()
                had = time.time()
                try:
                    yield waited
                finally:
                    if before is not None:  # a thread may raise its own nice value back without privilege
                        os.setpriority(os.PRIO_PROCESS, 0, before)
                    log_hold("turn", had, time.time(), waited)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


@contextmanager
def machine_share(*, path: str | None = None) -> Iterator[bool]:
    """A quiet probe's hold of the machine lock beside the turn's file, shared, over the block (its
    launch to its close); `load_turn` inside it takes that lock exclusively while it loads. Outside a
    quiet probe (no $KVPROBE_LOAD_TURN_QUIET, or no turn) nothing is held; yields whether it is."""
    path = path if path is not None else os.environ.get(TURN_ENV)
    if not path or os.environ.get(QUIET_ENV) != "1" or _shared:
        yield False
        return
    fd = os.open(path + ".quiet", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _enter(path, fd, fcntl.LOCK_SH, seconds=TURN_WAIT_SECONDS):
            raise ProbeError(f"waited {TURN_WAIT_SECONDS:.0f} s for the machine lock ({path}.quiet): a probe "
                             "that has the machine to itself has not stopped its load")
        _shared.append(fd)
        try:
            yield True
        finally:
            _shared.remove(fd)
    finally:
        os.close(fd)


@contextmanager
def _alone(path: str, *, log, wait_seconds: float) -> Iterator[float]:
    """Inside `machine_share`: its shared hold let go, the machine had exclusively (through `.want`,
    as every exclusive holder) for the block, then shared again; yields the seconds waited."""
    if not _shared:
        yield 0.0
        return
    fd = _shared[-1]
    fcntl.flock(fd, fcntl.LOCK_UN)  # a shared hold kept while waiting would deadlock two quiet probes
    asked = time.monotonic()
    had = _enter(path, fd, fcntl.LOCK_EX, seconds=wait_seconds)
    if not had:
        raise ProbeError(f"waited {wait_seconds:.0f} s for the machine to itself ({path}.quiet): the work beside "
                         "this probe has not finished")
    waited, start = time.monotonic() - asked, time.time()
    if log is not None and waited > 1:
        log(f"kvprobe: waited {waited:.0f} s for the machine to itself ({QUIET_ENV})")
    try:
        yield waited
    finally:
        log_hold("quiet", start, time.time(), waited)
        # shared again until the probe closes: its drain and its engine's stop stay out of another quiet ramp
        flock_within(fd, fcntl.LOCK_SH, seconds=wait_seconds)


@contextmanager
def machine_lock(base: str, *, exclusive: bool, seconds: float) -> Iterator[bool]:
    """The lock beside the turn's file `base` (`base`.quiet): shared by work that may run beside other
    work, exclusive for work that needs the machine to itself. Who wants it exclusively first holds
    `base`.want, which each shared holder passes through on its way in, so shared holders arriving one
    after another (a harness starts its next test milliseconds after the last) cannot keep it
    forever. Yields whether it was had within `seconds` (a caller that cannot raise decides)."""
    quiet = os.open(base + ".quiet", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        yield _enter(base, quiet, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, seconds=seconds)
    finally:
        os.close(quiet)  # closing a descriptor releases its lock


def _enter(base: str, quiet: int, mode: int, *, seconds: float) -> bool:
    """Lock `quiet` (the descriptor of `base`.quiet) in `mode`, passing through `base`.want in the same
    mode, within `seconds`: whether it was had."""
    end = time.monotonic() + seconds
    want = os.open(base + ".want", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        return all(flock_within(fd, mode, seconds=max(0.0, end - time.monotonic())) is not None
                   for fd in (want, quiet))
    finally:
        os.close(want)


def _acquire(fd: int, path: str, *, log, wait_seconds: float) -> float:
    def say() -> None:
        if log is not None:
            log(f"kvprobe: waiting for the load turn ({TURN_ENV}={path}, held by {holder(path)})")

    waited = flock_within(fd, fcntl.LOCK_EX, seconds=wait_seconds, on_wait=say)
    if waited is None:
        raise ProbeError(f"waited {wait_seconds:.0f} s for the load turn ({TURN_ENV}={path}, held by {holder(path)}); "
                         "another probe on this machine has not stopped its load")
    return waited


def flock_within(fd: int, mode: int, *, seconds: float, on_wait: Callable[[], None] | None = None) -> float | None:
    """`flock(fd, mode)` (LOCK_EX or LOCK_SH), polled for at most `seconds`: the seconds waited, or
    None when it was not had in time. `on_wait` is called once, when the first try finds it held."""
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return time.monotonic() - start
        except BlockingIOError:
            pass
        if time.monotonic() - start >= seconds:
            return None
        if on_wait is not None:
            on_wait()
            on_wait = None
        time.sleep(_POLL_SECONDS)


def _boost() -> int | None:
    """Raise this thread's priority (the processes and threads it starts inherit it); its nice value
    before, or None where the machine does not allow it."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, before - TURN_BOOST)
    except PermissionError:
        return None
    return before


def share_priority(pgid: int | None) -> bool:
    """Give the process group `pgid` this thread's priority: a load generator started before its
    turn (kvprobe.probe.run) takes the turn's boost when the turn is had. False where the machine
    does not allow it (no privilege) or the group is gone."""
    if pgid is None:
        return False
    try:
        os.setpriority(os.PRIO_PGRP, pgid, os.getpriority(os.PRIO_PROCESS, 0))
    except (PermissionError, ProcessLookupError):
        return False
    return True


def holder(path: str) -> str:
    """Who holds the turn, as its holder wrote it ("pid N"), or "an unknown process"."""
    try:
        with open(path, encoding="ascii") as f:
            pid = f.read().strip()
    except (OSError, UnicodeDecodeError):
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "an unknown process"


def log_hold(kind: str, start: float, end: float, waited: float, *, who: str | None = None,
             path: str | None = None) -> None:
    """Append one hold of a machine-wide lock (`kind`: "turn", or the suite's own) to the file
    $KVPROBE_LOAD_TURN_LOG names; nothing when it names none. Who held it: `who`, else the test pytest
    names in the environment it runs in (inherited by a probe's subprocess), else this process."""
    path = path if path is not None else os.environ.get(TURN_LOG_ENV)
    if not path:
        return
    who = who or os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or f"pid {os.getpid()}"
    line = json.dumps({"kind": kind, "start": round(start, 3), "end": round(end, 3), "waited": round(waited, 3),
                       "who": who, "worker": os.environ.get("PYTEST_XDIST_WORKER")}) + "\n"
    # one write on an O_APPEND descriptor: lines from the lanes' processes never interleave
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
