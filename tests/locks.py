"""Who holds a lock file, as the suite's tests of the load turn and the machine lock ask it."""

from __future__ import annotations

import fcntl
import os


def blocked(path: str, mode: int) -> bool:
    """Is `path` locked against `mode` (fcntl.LOCK_SH or LOCK_EX) right now?"""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
