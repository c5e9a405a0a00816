"""The LoadTestShape that follows a control file the parent writes.

The parent (LocustRun) writes `{"users": N, "spawn_rate": R}` (and optionally `"start_jitter": S`,
the first-request spread of this level's new users) or `{"stop": true}` atomically;
Locust calls tick() once a second on the process that runs the shape (the master in distributed
mode), and each tick watches the file for most of that second; the shape returns (users,
spawn_rate), or None to end the test. A hard time limit makes
Locust stop by itself even if the parent vanished. A run started idle, ahead of its load (a probe
starts its client before it waits for the machine's load turn: kvprobe.load.turns), has an idle
limit for the wait and its time limit from its first level with users.

`ShapeControl` is the pure logic (tested without Locust); `make_shape_class()` imports Locust and
is only called inside the Locust process, so importing this module never monkey-patches anything.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def write_control(path: str | os.PathLike, **payload) -> None:
    """Atomically replace the control file (write a temp file in the same dir, then rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".control-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_spawn_rate(users: int) -> float:
    # Spawn any level in about one second (Locust's shape granularity): a level is reached within
    # one tick and the level record marks it.
    return float(max(1, users))


class ShapeControl:
    """tick() -> (users, spawn_rate) | None from the control file, with a hard time limit.

    A missing or unreadable control file keeps the last good value (initially 0 users): a torn
    write cannot happen (atomic rename), but a stray edit must not crash the load generator.
    With an `idle_limit` the run may wait that long for its first level with users, and its
    `time_limit` counts from that level; without one, the time limit counts from the start.
    """

    def __init__(self, path: str | os.PathLike, time_limit: float, *, idle_limit: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.time_limit = float(time_limit)
        self.idle_limit = float(idle_limit) if idle_limit else None
        self.clock = clock
        self.t0 = clock()
        self.loaded_at: float | None = None  # when a level first asked for users (with an idle limit)
        self.current: tuple[int, float] = (0, 1.0)
        self.stopped_reason: str | None = None
        self.bad_reads = 0
        self.start_jitter: float | None = None  # the level's, when the control file names one
        self._stamp: tuple[int, int] | None = None

    def _read(self) -> dict | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp == self._stamp:
            return None  # unchanged since the last tick
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.bad_reads += 1
            return None
        self._stamp = stamp
        return data if isinstance(data, dict) else None

    def tick(self) -> tuple[int, float] | None:
        if self.stopped_reason is not None:
            return None
        now = self.clock()
        if self.idle_limit is not None and self.loaded_at is None:
            if now - self.t0 >= self.idle_limit:
                self.stopped_reason = "idle_limit"
                return None
        elif now - (self.loaded_at if self.idle_limit is not None else self.t0) >= self.time_limit:
            self.stopped_reason = "time_limit"
            return None
        data = self._read()
        if data is not None:
            if data.get("stop"):
                self.stopped_reason = "control"
                return None
            users = data.get("users")
            if isinstance(users, int) and users >= 0:
                rate = data.get("spawn_rate")
                rate = float(rate) if isinstance(rate, (int, float)) and rate > 0 else default_spawn_rate(users)
                self.current = (users, rate)
                if users and self.loaded_at is None:
                    self.loaded_at = now
                jitter = data.get("start_jitter")
                self.start_jitter = float(jitter) if isinstance(jitter, (int, float)) and jitter >= 0 else None
            else:
                self.bad_reads += 1
        return self.current


# How long one tick watches the control file for a change, and how often it looks: Locust calls the
# shape once a second, so a tick that watches 0.9 s of it sees a level asked for a second or more
# after the last one within about a tenth of a second (it was up to a second).
WATCH_SECONDS = 0.9
WATCH_POLL_SECONDS = 0.05


def make_shape_class(on_new_level: Callable[[int, float, float | None], None] | None = None,
                     on_idle: Callable[[float], None] | None = None):
    """The LoadTestShape subclass for the locustfile. `on_new_level(users, t_set, start_jitter)` is
    called when tick() hands Locust a new user count (before Locust starts spawning it), with the
    level's start jitter when the control file names one (else None). `on_idle(t)` is called
    at the first tick when the control file asks for no users: Locust runs none yet, and the tick
    watches for the first level at once instead of handing Locust an empty one and sleeping out the
    second after it (a second more before every probe's first level)."""
    import gevent  # imported here: only ever inside the Locust process
    from locust import LoadTestShape

    class ControlFileShape(LoadTestShape):
        use_common_options = False
        _control: ShapeControl | None = None
        _last_users: int | None = None
        _last_out: tuple[int, float] | None = None

        def tick(self):
            opts = self.runner.environment.parsed_options
            if self._control is None:
                self._control = ShapeControl(opts.kv_control, opts.kv_time_limit, idle_limit=opts.kv_idle_limit)
            out = self._control.tick()
            if self._last_out is None and out is not None and out[0] == 0:
                self._last_out, self._last_users = out, 0
                if on_idle is not None:
                    on_idle(time.time())
            # Locust asks once a second (its shape worker sleeps out the rest of the second), so a
            # level asked for between two ticks waited half a second on average, every level. A tick
            # that finds nothing new watches the file for most of its second and answers as soon as
            # it changes (the second after a change stays unwatched: Locust sleeps it out).
            watch_end = time.monotonic() + WATCH_SECONDS
            while out is not None and out == self._last_out and time.monotonic() < watch_end:
                gevent.sleep(WATCH_POLL_SECONDS)
                out = self._control.tick()
            self._last_out = out
            if out is not None and out[0] != self._last_users:
                self._last_users = out[0]
                if on_new_level is not None:
                    on_new_level(out[0], time.time(), self._control.start_jitter)
            return out

    return ControlFileShape
