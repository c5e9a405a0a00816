"""The vLLM shadow target's tests run vLLM 0.33.0's own code (and 0.18.1's, for the release pair): the
engine environment is installed when it is missing (never skipped), once per session, with its progress
on the terminal."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from kvprobe.targets.shadow import envs, recipes
from tests.conftest import add_figure

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.33.0"


@pytest.fixture(scope="session")
def vllm_env(pytestconfig):
    """The environment, installed when missing. Its cache folder is pinned for the session:
    pytester moves HOME, and with it the default ~/.cache/kvprobe a probe run inside it would read."""
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")

    def log(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line)

    mp = pytest.MonkeyPatch()
    mp.setenv(envs.CACHE_ENV, str(envs.cache_root()))
    yield envs.ensure("vllm", VERSION, log=log)  # ~90 s warm pip cache, 2-3 min cold
    mp.undo()


@pytest.fixture(scope="session")
def vllm_release_env(pytestconfig):
    """`vllm_release_env(VERSION)`: any vLLM release with a shadow recipe (0.18.1 beside 0.33.0),
    installed when missing, the first time a test of the session asks for it."""
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    mp = pytest.MonkeyPatch()
    mp.setenv(envs.CACHE_ENV, str(envs.cache_root()))

    def get(version: str) -> envs.EngineEnv:
        return recipes.ensure("vllm", version, log=reporter.write_line if reporter is not None else print)

    yield get
    mp.undo()


@pytest.fixture
def say(capsys, request):
    """Print the measured figures to the terminal as the test ends, pass or fail (not captured),
    and keep them for the run's summary, which collects them from every worker (tests/conftest.py)."""

    def write(text: str) -> None:
        with capsys.disabled():
            print(text.rstrip(), flush=True)
        add_figure(request.node, text)
    return write


_PID = re.compile(r"\((?:APIServer|EngineCore)(?:_DP\d+)? pid=(\d+)\)")


def engine_pids(log_path: Path) -> set[int]:
    """The API server's and EngineCore's pids, as vLLM's log prefix names them."""
    return {int(m.group(1)) for m in _PID.finditer(log_path.read_text(errors="replace"))}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie holds nothing
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture
def console_tmpdir():
    """The environment of a `kvprobe shadow vllm` started by a test. That command becomes `vllm serve`
    (exec), whose ZMQ sockets go to the temporary folder (VLLM_RPC_BASE_PATH, vLLM 0.33.0 envs.py) and
    stay there after it stops: a test's go to a folder of its own, removed after it. A short one
    under /tmp: a socket's path must fit sockaddr_un (107 bytes), which a pytest tmp_path under
    xdist does not leave room for."""
    scratch = tempfile.mkdtemp(prefix="kvprobe-console-")
    yield {"TMPDIR": scratch}
    shutil.rmtree(scratch, ignore_errors=True)
