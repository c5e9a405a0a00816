"""The ports kvprobe picks for the servers it starts: below the kernel's ephemeral range (where no
client connection or engine-internal bind(0) lands), never one held, never the same twice, never one
another live kvprobe process on the machine picked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from kvprobe import procgroup
from kvprobe.procgroup import ephemeral_floor, free_port, port_in_use


def test_ports_come_from_below_the_ephemeral_range_each_once_and_free():
    floor = ephemeral_floor()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(procgroup.PICK_FLOOR <= p < floor for p in ports)
    assert not any(port_in_use("127.0.0.1", p) for p in ports[:20])


def test_a_held_port_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        spare = free_port()  # free now, and issued: it must come back only through the fake draw below
        procgroup._issued.discard(spare)
        with procgroup._machine_picks() as picks:
            picks.pop(spare)
        draws = iter([taken, spare])
        monkeypatch.setattr(procgroup, "_rng", type("Draws", (), {"randrange": lambda self, a, b: next(draws)})())
        assert free_port() == spare


def test_the_range_is_read_from_the_kernel_and_defaults_where_unreadable(tmp_path):
    rng = tmp_path / "ip_local_port_range"
    rng.write_text("40000\t60999\n")
    assert ephemeral_floor(rng) == 40000
    assert ephemeral_floor(tmp_path / "missing") == 32768
    rng.write_text("garbage")
    assert ephemeral_floor(rng) == 32768


def test_no_room_below_the_range_lets_the_os_pick(monkeypatch):
    monkeypatch.setattr(procgroup, "ephemeral_floor", lambda: procgroup.PICK_FLOOR + 10)
    ports = {free_port() for _ in range(5)}
    assert len(ports) == 5 and not any(port_in_use("127.0.0.1", p) for p in ports)


def test_a_port_another_live_kvprobe_process_picked_is_skipped_and_a_dead_ones_is_not(monkeypatch, tmp_path):
    # the suite's two lanes pick from the same band, and an engine binds a minute after the pick: a
    # clean clone's SGLang shadow found its port served by the other lane's vLLM
    monkeypatch.setattr(procgroup, "PORTS_FILE", tmp_path / "kvprobe-ports")
    other = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    dead = int(other.stdout)  # exited: its picks are void
    live, dead_port = free_port(), free_port()
    for port in (live, dead_port):
        procgroup._issued.discard(port)  # as if this process had never picked them
    (tmp_path / "kvprobe-ports").write_text(f"{live} {os.getppid()}\n{dead_port} {dead}\n")
    draws = iter([live, dead_port])
    monkeypatch.setattr(procgroup, "_rng", type("Draws", (), {"randrange": lambda self, a, b: next(draws)})())
    assert free_port() == dead_port
    lines = (tmp_path / "kvprobe-ports").read_text().splitlines()
    assert sorted(lines) == sorted([f"{live} {os.getppid()}", f"{dead_port} {os.getpid()}"])
