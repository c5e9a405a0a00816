"""`workers:` in a load profile: one clear line naming the file, the key and what was expected."""

from __future__ import annotations

import pytest
import yaml

from kvprobe.errors import ConfigError
from kvprobe.spec.profile import load_profile
from kvprobe.verdict.checks import check_rejection_point, unjudged_if_starved

BASE = {"name": "w", "request": {"prompt_tokens": 128, "output_tokens": 32},
        "ramp": {"strategy": "explicit", "levels": [4, 8]}, "hold": {"seconds": 3}}


def _load(tmp_path, **extra):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({**BASE, **extra}))
    return path, load_profile(path)


def test_defaults_and_a_full_bind(tmp_path):
    _, prof = _load(tmp_path, workers={"expect": 3})
    assert (prof.workers.expect, prof.workers.host, prof.workers.port, prof.workers.wait_seconds) == \
        (3, "127.0.0.1", None, 60.0)
    _, prof = _load(tmp_path, workers={"expect": 8, "bind": "0.0.0.0:5557", "wait_seconds": 120})
    assert (prof.workers.host, prof.workers.port, prof.workers.wait_seconds) == ("0.0.0.0", 5557, 120.0)
    assert _load(tmp_path)[1].workers is None


@pytest.mark.parametrize("workers, extra, key, expected", [
    ("4", {}, "workers", "expected a mapping with expect"),
    ({"bind": "0.0.0.0:5557"}, {}, "workers.expect", "expected this key to be present"),
    ({"expect": 0}, {}, "workers.expect", "expected a number of Locust workers to wait for"),
    ({"expect": 2, "bind": "0.0.0.0:99999"}, {}, "workers.bind", "expected HOST:PORT with a port from 1 to 65535"),
    ({"expect": 2, "bind": 5557}, {}, "workers.bind", "expected HOST:PORT (or HOST) the master listens on"),
    ({"expect": 2, "wait_seconds": 0}, {}, "workers.wait_seconds", "expected seconds to wait for the workers"),
    ({"expect": 2, "expected": 3}, {}, "workers", "'expect'"),
    ({"expect": 2}, {"processes": 2}, "processes", "expected 1 (or no `processes`) when `workers` is set"),
])
def test_broken_workers_is_one_clear_line(tmp_path, workers, extra, key, expected):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, workers=workers, **extra)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'w.yaml'}: {key}"), message
    assert expected in message, message


def test_a_saturated_worker_makes_the_rejection_point_inconclusive_naming_it():
    from types import SimpleNamespace

    from kvprobe.analysis.client import starvation
    from kvprobe.analysis.plateau import RejectionPoint
    from kvprobe.load.health import client_health
    from kvprobe.load.records import Record
    from kvprobe.spec.schema import Tolerances

    lag = [Record(kind="lag", worker=w, host=h, lag_ms=ms, cpu=0.4, t=float(t))
           for w, h, ms in (("w0", "loadA", 3.0), ("w1", "loadB", 37.0)) for t in range(5)]
    starved = starvation([], client_health(lag))
    nothing = RejectionPoint(None, None, None, [], None)
    check = unjudged_if_starved(check_rejection_point(SimpleNamespace(limit=20.0, binding="kv"), nothing,
                                                      Tolerances()), starved)
    assert check.inconclusive and not check.passed
    assert "worker w1 on loadB: loop lag p99 37.0 ms > 15 ms" in check.reason, check.reason


def test_the_worker_command_refuses_a_master_without_a_port(capsys):
    from kvprobe.cli.main import main

    assert main(["worker", "--master", "loadhost"]) == 2
    err = capsys.readouterr().err
    assert "kvprobe worker: error: --master: expected HOST:PORT with the port the probe prints, got 'loadhost'" in err
    assert main(["worker", "--master", "h:1", "--processes", "0"]) == 2
    assert "--processes: expected a number of worker processes >= 1, got 0" in capsys.readouterr().err


def test_the_worker_runs_locust_as_a_message_mode_worker_of_that_master():
    from kvprobe.load.runner import LOCUSTFILE
    from kvprobe.load.worker import command

    cmd = command("10.1.2.3:5557", processes=3)
    assert cmd[1:5] == ["-m", "locust", "-f", str(LOCUSTFILE)]
    joined = " ".join(cmd)
    assert "--worker --master-host 10.1.2.3 --master-port 5557" in joined
    assert "--kv-transport message" in joined and "--processes 3" in joined
