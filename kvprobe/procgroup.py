"""Process groups we start, and the ports they listen on.

Every server or load generator kvprobe starts runs in its own process group
(`start_new_session=True`); stopping it means SIGTERM to the group, SIGKILL to the group after a
grace period, and checking that no member is left. Nothing is ever found or killed by name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil

# The ports kvprobe hands to the servers it starts come from below the kernel's ephemeral range.
# Every connect() and bind(0) on the machine draws from that range, so a port the OS picked there
# and we released can be taken, before the engine binds it, by any client connection or by an
# engine's own sockets (torch's store, gloo, zmq): CI saw two SGLang shadows started at once find
# one's port taken. Below the range only pickers like this one choose; this process never hands
# out the same port twice, and another process's picker collides once in a few thousand. SGLang from
# 0.5.22 is such a picker too: its scheduler's TCP store port is drawn from 22000-29999 and bound
# seconds later (srt/utils/network.py get_free_port_below_ephemeral, 0.5.23 L205-224; server_args.py
# PortArgs.init_new L771-775), so CI saw a shadow's HTTP port taken by another shadow's store. The
# floor sits above that band: 30000 up to the ephemeral range (32768 by default).
PICK_FLOOR = 30000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Other kvprobe processes on the machine (the suite's other lane, a second probe) pick from the same
# band, and an engine binds its port up to a minute after the pick (SGLang's HTTP server starts once
# its scheduler has): long enough for another process to find the port still free and give it to its
# own engine. A clean clone saw an SGLang shadow's health check answered, and its probe refused, by
# the other lane's vLLM on the same port. So each pick is written to this file, under its lock, with
# the picker's process id; a port that a live process picked is not picked again.
PORTS_FILE = Path(tempfile.gettempdir()) / "kvprobe-ports"
_PICK_TRIES = 200
_issued: set[int] = set()
_issue_lock = threading.Lock()
_rng = random.SystemRandom()


def ephemeral_floor(path: Path = EPHEMERAL_RANGE) -> int:
    """The lowest port the kernel hands to connect() and bind(0) (Linux's default where unreadable)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, outside the ephemeral range when there is room below it,
    and that no live kvprobe process on the machine picked (PORTS_FILE).

    A race with a process that is not kvprobe binding the same port remains; it is what
    `port_in_use` reports.
    """
    top = ephemeral_floor()
    with _issue_lock, _machine_picks() as picked:
        for _ in range(_PICK_TRIES if top - PICK_FLOOR >= 1000 else 0):
            port = _rng.randrange(PICK_FLOOR, top)
            if port not in _issued and port not in picked and _bindable(host, port):
                break
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no room below: the OS picks
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        _issued.add(port)
        picked[port] = os.getpid()
        return port


@contextlib.contextmanager
def _machine_picks(path: Path | None = None):
    """{port: pid} of the ports live kvprobe processes picked (PORTS_FILE), held under the file's lock
    for the block and written back after it; the dead's picks are dropped. A file that cannot be
    opened leaves the picks to this process alone."""
    path = path or PORTS_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield {}
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        picks: dict[int, int] = {}
        with os.fdopen(os.dup(fd), "r", encoding="ascii", errors="replace") as fh:
            for line in fh.read().splitlines():
                port, _, pid = line.partition(" ")
                if port.isdigit() and pid.isdigit() and psutil.pid_exists(int(pid)):
                    picks[int(port)] = int(pid)
        yield picks
        os.ftruncate(fd, 0)
        os.pwrite(fd, "".join(f"{port} {pid}\n" for port, pid in sorted(picks.items())).encode(), 0)
    finally:
        os.close(fd)  # the lock goes with it


def _bindable(host: str, port: int) -> bool:
    """Strict: without SO_REUSEADDR, a port in TIME_WAIT or bound by a client counts as taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_in_use(host: str, port: int) -> bool:
    """True when a listener holds host:port. SO_REUSEADDR as servers set it, so TIME_WAIT is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def id_passed_on(proc: subprocess.Popen, pgid: int) -> bool:
    """Has the id of the group `proc` led passed to another process since `proc` was reaped?

    Linux frees a pid for reuse once no process uses it as its id, group or session, so while the
    leader is unreaped, or any member of its group lives, no other process can have it. Reaped, with
    a live process of that very pid, the group we started is gone and the id names someone else's
    (pid_max is 32768 on many machines: a suite wraps it). A group's id is its leader's pid."""
    return pgid == proc.pid and proc.returncode is not None and psutil.pid_exists(pgid)


def group_members(pgid: int, proc: subprocess.Popen | None = None) -> list[int]:
    """Live (non-zombie) processes of the group. Zombies count as gone: they hold no memory or GPU.
    Given the group's leader `proc`, a group whose id has passed to another process has none."""
    if proc is not None and id_passed_on(proc, pgid):
        return []
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass  # a member we cannot signal still counts; fall through to the scan
    members = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return members


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_own_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the group `proc` leads, unless it is gone and its id has passed on (`id_passed_on`)."""
    if not id_passed_on(proc, proc.pid):
        signal_group(proc.pid, sig)


def stop_group(proc: subprocess.Popen, pgid: int, grace: float) -> tuple[bool, list[int]]:
    """SIGTERM the group, SIGKILL it after `grace`; reap the leader. Returns (killed, survivors).
    A group that is gone is not signalled: its id may name another's group by now (`id_passed_on`)."""
    if id_passed_on(proc, pgid):
        return False, []
    signal_group(pgid, signal.SIGTERM)
    if wait_group_gone(proc, pgid, time.monotonic() + grace):
        return False, []
    if id_passed_on(proc, pgid):
        return False, []
    signal_group(pgid, signal.SIGKILL)
    if wait_group_gone(proc, pgid, time.monotonic() + 5.0):
        return True, []
    return True, group_members(pgid, proc)


def wait_group_gone(proc: subprocess.Popen, pgid: int, deadline: float) -> bool:
    delay = 0.01
    while True:
        proc.poll()  # reaps the leader; its pgid stays reserved while other members live
        if proc.returncode is not None and not group_members(pgid, proc):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM takes Ctrl-C's path inside the block, so the caller's `finally` stops every process
    group it started either way; the previous handler comes back afterwards (an in-process caller
    keeps its own)."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
