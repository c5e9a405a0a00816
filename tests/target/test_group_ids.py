"""A group id outlives its group only as a number: once our leader is reaped and the group is gone,
Linux may hand the number to the next process (pid_max is 32768 here, and a suite wraps it), and
that process may lead a group of its own — someone's engine. Stopping, waiting for or emergency-
stopping a group of ours must then leave that group alone, and must still reach a member of ours
that outlived its leader.

The reuse is staged, not waited for: a finished, reaped Popen is pointed at a live bystander group's
id, which is exactly what a stale Popen sees after the kernel reused the number.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvprobe.procgroup import group_members, id_passed_on, stop_group, wait_group_gone
from kvprobe.targets.launch import _emergency_stop

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def bystander():
    """A live process group that is not ours to stop (its leader's pid is its group id)."""
    proc = subprocess.Popen(SLEEPER, start_new_session=True)
    yield proc
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def reaped_with_its_id_reused(bystander):
    """A group leader of ours that exited and was reaped, whose id now names `bystander`'s group."""
    ours = subprocess.Popen(["true"], start_new_session=True)
    ours.wait(timeout=10)
    ours.pid = bystander.pid  # what the kernel's reuse of the number amounts to, seen from our Popen
    return ours


def test_a_reused_id_is_seen_as_passed_on_and_its_group_is_not_ours(reaped_with_its_id_reused, bystander):
    assert id_passed_on(reaped_with_its_id_reused, bystander.pid)
    assert group_members(bystander.pid) == [bystander.pid]
    assert group_members(bystander.pid, reaped_with_its_id_reused) == []


@pytest.mark.parametrize("stop", [
    pytest.param(lambda ours, pgid: stop_group(ours, pgid, grace=1.0), id="stop_group"),
    pytest.param(_emergency_stop, id="Target finalizer"),
])
def test_stopping_a_gone_group_leaves_the_group_that_now_has_its_id(reaped_with_its_id_reused, bystander, stop):
    stop(reaped_with_its_id_reused, bystander.pid)
    assert bystander.poll() is None, f"the bystander group was signalled ({bystander.returncode})"
    assert wait_group_gone(reaped_with_its_id_reused, bystander.pid, deadline=0.0)


def test_a_member_that_outlived_its_reaped_leader_is_still_stopped():
    """The leader exits at once; the sleeper it left keeps the group's id reserved, so the id has not
    passed on and the group is ours to stop."""
    leader = subprocess.Popen(["sh", "-c", f"'{sys.executable}' -c 'import time; time.sleep(60)' & echo $!"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    member = int(leader.stdout.readline())
    leader.wait(timeout=10)
    leader.stdout.close()
    assert not id_passed_on(leader, leader.pid)
    assert group_members(leader.pid, leader) == [member]
    killed, survivors = stop_group(leader, leader.pid, grace=5.0)
    assert (killed, survivors) == (False, [])
    assert group_members(leader.pid) == []
