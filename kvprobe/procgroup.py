"""Process groups we start, and the ports they listen on.

Every server or load generator kvprobe starts runs in its own process group
(`start_new_session=True`); stopping it means SIGTERM to the group, SIGKILL to the group after a
grace period, and checking that no member is left. Nothing is ever found or killed by name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import time

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it; a race with another process remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the group. Zombies count as gone: they hold no memory or GPU."""
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


def stop_group(proc: subprocess.Popen, pgid: int, grace: float) -> tuple[bool, list[int]]:
    """SIGTERM the group, SIGKILL it after `grace`; reap the leader. Returns (killed, survivors)."""
    signal_group(pgid, signal.SIGTERM)
    if wait_group_gone(proc, pgid, time.monotonic() + grace):
        return False, []
    signal_group(pgid, signal.SIGKILL)
    if wait_group_gone(proc, pgid, time.monotonic() + 5.0):
        return True, []
    return True, group_members(pgid)


def wait_group_gone(proc: subprocess.Popen, pgid: int, deadline: float) -> bool:
    delay = 0.01
    while True:
        proc.poll()  # reaps the leader; its pgid stays reserved while other members live
        if proc.returncode is not None and not group_members(pgid):
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
