import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def kvp(pytester):
    """A pytester project with the repo's load profiles and a probe-sized emulated expectation."""
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider\n")
    (pytester.path / "loadprofiles").mkdir()
    for f in (REPO / "kvprobe" / "loadprofiles").glob("*.yaml"):
        (pytester.path / "loadprofiles" / f.name).write_text(f.read_text())
    (pytester.path / "expectations").mkdir()
    return pytester


def pgid_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


__all__ = ["pgid_alive", "signal"]
